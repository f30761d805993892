// Artery console: live updates over Server-Sent Events (fed by NATS subscriptions on the
// server), charts drawn with uPlot. Each event becomes a DOM event on <body> named by its kind
// (train, group, checkpoint, replica, dead_letter), which htmx fragments listen for.
(function () {
  "use strict";
  const COLORS = ["#4f46e5", "#10b981", "#ef4444", "#f59e0b", "#0ea5e9", "#a855f7", "#64748b", "#ec4899"];
  let source = null;

  function connect(params) {
    if (source) source.close();
    const query = new URLSearchParams(params || {}).toString();
    source = new EventSource("/events" + (query ? "?" + query : ""));
    const live = () => document.getElementById("live");
    source.onopen = () => { const el = live(); if (el) { el.textContent = "● live"; el.classList.add("on"); } };
    source.onerror = () => { const el = live(); if (el) { el.textContent = "● reconnecting"; el.classList.remove("on"); } };
    for (const kind of ["train", "group", "checkpoint", "replica", "dead_letter"]) {
      source.addEventListener(kind, (e) => {
        document.body.dispatchEvent(new CustomEvent(kind, { detail: JSON.parse(e.data) }));
      });
    }
  }

  // Rows keyed by step, merged from several sources, as uPlot's column arrays.
  function columns(rowsBySeries) {
    const steps = new Set();
    for (const rows of Object.values(rowsBySeries)) for (const [x] of rows) steps.add(x);
    const xs = [...steps].sort((a, b) => a - b);
    const data = [xs];
    for (const rows of Object.values(rowsBySeries)) {
      const byStep = new Map(rows);
      data.push(xs.map((x) => (byStep.has(x) ? byStep.get(x) : null)));
    }
    return data;
  }

  function chart(el, title, rowsBySeries) {
    const names = Object.keys(rowsBySeries);
    const data = columns(rowsBySeries);
    const opts = {
      title: title, width: Math.max(el.clientWidth - 10, 300), height: 220,
      scales: { x: { time: false } },
      axes: [{ label: "step", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000] }, {}],
      series: [{ label: "step" }].concat(names.map((name, i) => ({
        label: name, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true,
        points: { show: true, size: 5 },
      }))),
    };
    if (el._plot) el._plot.destroy();
    el.innerHTML = "";
    el._plot = new uPlot(opts, data, el);
    el.dataset.points = String(data[0].length);
  }

  function pick(steps, key) {
    return steps.filter((s) => typeof s[key] === "number").map((s) => [s.step, s[key]]);
  }

  function modelPage(root) {
    const project = root.dataset.project, model = root.dataset.model;
    const url = `/api/models/${encodeURIComponent(project)}/${encodeURIComponent(model)}/curve`;
    let extra = [];  // steps announced by train.completed before PostgreSQL answered with them

    async function draw() {
      const curve = await (await fetch(url)).json();
      const known = new Set(curve.steps.map((s) => s.step));
      extra = extra.filter((s) => !known.has(s.step));
      const steps = curve.steps.concat(extra).sort((a, b) => a.step - b.step);
      document.getElementById("step-count").textContent = `(${steps.length} steps)`;
      chart(document.getElementById("reward-chart"), "reward", {
        "train mean": pick(steps, "reward_mean"),
        "train min": pick(steps, "reward_min"),
        "train max": pick(steps, "reward_max"),
        "val mean": curve.val.map((v) => [v.step, v.reward_mean]),
      });
      const loss = { loss: pick(steps, "loss") };
      for (const key of ["kl", "kl_div", "kl_penalty"]) if (steps.some((s) => typeof s[key] === "number")) loss[key] = pick(steps, key);
      chart(document.getElementById("loss-chart"), "loss", loss);
      const offKeys = [...new Set(steps.flatMap((s) => Object.keys(s)).filter((k) => k.startsWith("offpolicy/")))].sort();
      document.getElementById("offpolicy-section").hidden = offKeys.length === 0;
      if (offKeys.length) {
        chart(document.getElementById("offpolicy-chart"), "off-policy",
          Object.fromEntries(offKeys.map((k) => [k.slice("offpolicy/".length), pick(steps, k)])));
      }
      const judged = curve.judge.filter((j) => j.cost_usd !== null && j.step !== null);
      document.getElementById("judge-section").hidden = judged.length === 0;
      if (judged.length) chart(document.getElementById("judge-chart"), "judge cost", { "USD": judged.map((j) => [j.step, j.cost_usd]) });
    }

    document.body.addEventListener("train", (e) => {
      const d = e.detail;
      if (d.event === "train.completed" && d.project === project && d.model === model) {
        extra.push(Object.assign({ step: d.step }, d.metrics || {}));
        draw();
      }
    });
    let pending = null;  // stored groups (val splits) redraw too, once they stop arriving
    document.body.addEventListener("group", () => {
      clearTimeout(pending);
      pending = setTimeout(draw, 500);
    });
    connect({ project: project, model: model });
    draw();
  }

  window.ArteryConsole = { connect: connect, modelPage: modelPage };
  document.addEventListener("DOMContentLoaded", () => { if (!source) connect(); });
})();
