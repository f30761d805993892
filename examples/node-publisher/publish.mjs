#!/usr/bin/env node
// Publish Artery trajectory groups from Node.js: plain JSON objects, the npm `nats` client, no
// Python anywhere. The payload and headers follow the wire contract only (schemas/trajectory.py,
// schemas/base.py and, when generated, schemas/generated/jsonschema/trajectory_group.json and
// schemas/generated/asyncapi.json); see README.md.
//
// Environment:
//   ARTERY_NATS_URL  NATS server(s), comma-separated   (default nats://127.0.0.1:4222)
//   ARTERY_PROJECT   project name                      (default demo)
//   ARTERY_MODEL     model name                        (default node-agent)
//   ARTERY_GROUPS    how many groups to publish        (default 1)
//   ARTERY_STEP      policy version the rollouts used  (optional, an integer >= 0)
//
// For each group it waits for the JetStream ack and prints one JSON line to stdout:
//   {"id": "<event id>", "stream": "ARTERY_TRAJECTORIES", "seq": 42}

import { randomBytes, randomUUID } from "node:crypto";
import { connect, headers } from "nats";

// Project and model names (schemas/base.py NAME_PATTERN): a dot inside, never first or last.
const NAME_PATTERN = /^[A-Za-z0-9_-](?:[A-Za-z0-9_.-]{0,62}[A-Za-z0-9_-])?$/;
// A name is one subject token: its dots are written "=2E" (shared/subjects.py token), since a dot
// separates tokens ("a.b" would otherwise read as project "a", model "b").
const token = (value) => value.replaceAll(".", "=2E");
// Sent in the Artery-Schema header (schemas/base.py SCHEMA_VERSION).
const SCHEMA_VERSION = "1";
// The tag of TrajectoryGroupSubmitted: the value of the envelope's "event" field.
const EVENT_TAG = "trajectory_group";

function fail(message) {
  process.stderr.write(`publish.mjs: ${message}\n`);
  process.exit(1);
}

function name(variable, fallback) {
  const value = process.env[variable] || fallback;
  if (!NAME_PATTERN.test(value)) {
    fail(`${variable}=${JSON.stringify(value)} must match ${NAME_PATTERN} (a project or model name)`);
  }
  return value;
}

function nonNegativeInt(variable, fallback) {
  const raw = process.env[variable];
  if (raw === undefined || raw === "") return fallback;
  if (!/^\d+$/.test(raw)) fail(`${variable}=${JSON.stringify(raw)} must be an integer >= 0`);
  return Number.parseInt(raw, 10);
}

// W3C trace context: version 00, a random 16-byte trace id, a random 8-byte parent span id,
// flags 01 (sampled). All-zero ids are invalid, so retry in that (astronomically rare) case.
function traceparent() {
  const hex = (n) => {
    for (;;) {
      const value = randomBytes(n).toString("hex");
      if (/[^0]/.test(value)) return value;
    }
  };
  return `00-${hex(16)}-${hex(8)}-01`;
}

// A stand-in for what an inference engine returns with logprobs: one token id and one logprob
// per "token" (here: per character), with exactly as many logprobs as token ids.
function fakeSample(text, seed) {
  const token_ids = [...text].map((ch) => 1000 + ((ch.codePointAt(0) * 31 + seed) % 30000));
  const logprobs = token_ids.map((_, i) => -Number((0.05 + ((i * 7 + seed) % 13) / 10).toFixed(3)));
  return { token_ids, logprobs, finish_reason: "stop" };
}

// One group: four rollouts of the same question, each answered differently and rewarded by the
// agent itself (no "reward" spec, so these rewards are final).
function buildGroup({ project, model, step, index }) {
  const a = 3 + index;
  const b = 4 + 2 * index;
  const correct = a * b;
  const question = `What is ${a} * ${b}? Answer with the number only.`;
  const answers = [
    { text: String(correct), reward: 1.0, verdict: "correct" },
    { text: `${correct}.`, reward: 0.75, verdict: "correct_with_punctuation" },
    { text: `I think it is ${correct + 1}`, reward: 0.25, verdict: "wrong_and_verbose" },
    { text: String(correct - a), reward: 0.0, verdict: "wrong" },
  ];
  const trajectories = answers.map((answer, i) => ({
    messages: [
      { role: "system", content: "You are a careful arithmetic assistant." },
      { role: "user", content: question },
      { role: "assistant", content: answer.text, sample: fakeSample(answer.text, 97 * index + i) },
    ],
    reward: answer.reward,
    metrics: {
      answer_chars: answer.text.length,
      correct: answer.reward >= 0.75,
      latency_s: Number((0.2 + 0.05 * i).toFixed(2)),
    },
    metadata: { rollout: i, verdict: answer.verdict, client: "node-publisher" },
    logs: [`rollout ${i}: answered ${JSON.stringify(answer.text)}`],
    ...(step === undefined ? {} : { initial_policy_version: step, final_policy_version: step }),
  }));
  return {
    // The envelope (schemas/base.py Event).
    event: EVENT_TAG,
    id: randomUUID(),
    project,
    model,
    ...(step === undefined ? {} : { step }),
    time: new Date().toISOString(), // RFC 3339, UTC
    // TrajectoryGroupSubmitted (schemas/trajectory.py).
    trajectories,
    metadata: { task: "multiplication", question_index: index, language: "javascript" },
    metrics: { num_correct: answers.filter((x) => x.reward >= 0.75).length },
    logs: [`group ${index} built by publish.mjs`],
    split: "train",
  };
}

async function main() {
  const servers = (process.env.ARTERY_NATS_URL || "nats://127.0.0.1:4222")
    .split(",")
    .map((s) => s.trim())
    .filter(Boolean);
  const project = name("ARTERY_PROJECT", "demo");
  const model = name("ARTERY_MODEL", "node-agent");
  const count = nonNegativeInt("ARTERY_GROUPS", 1);
  const step = nonNegativeInt("ARTERY_STEP", undefined);
  const subject = `artery.traj.${token(project)}.${token(model)}`;

  let nc;
  try {
    nc = await connect({ servers, name: "artery-node-publisher", timeout: 10_000 });
  } catch (err) {
    throw new Error(`cannot connect to ${servers.join(",")}: ${err.message || err}`);
  }
  try {
    const js = nc.jetstream();
    for (let index = 0; index < count; index++) {
      const group = buildGroup({ project, model, step, index });
      const h = headers();
      // De-duplication key: the event id within its tenant, <project>.<model>.<id>
      h.set("Nats-Msg-Id", `${group.project}.${group.model}.${group.id}`);
      h.set("Content-Type", "application/json");
      h.set("Artery-Schema", SCHEMA_VERSION);
      h.set("Artery-Event", EVENT_TAG);
      h.set("traceparent", traceparent());
      const data = new TextEncoder().encode(JSON.stringify(group));
      let ack;
      try {
        ack = await js.publish(subject, data, { headers: h, timeout: 10_000 });
      } catch (err) {
        const hint = String(err).includes("503")
          ? " (no stream listens on this subject: is the Artery stack, or its collector, running?)"
          : "";
        throw new Error(`publishing ${group.id} on ${subject} failed: ${err.message || err}${hint}`);
      }
      process.stdout.write(`${JSON.stringify({ id: group.id, stream: ack.stream, seq: ack.seq })}\n`);
    }
  } finally {
    await nc.drain();
  }
}

main().catch((err) => fail(err.message || String(err)));
