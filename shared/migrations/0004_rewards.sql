-- The reward service's verdict on a group that asked for a judge (RULER). A group that needs a
-- reward is ready for training once it has a row here: with scores, or with the error that sent
-- it to the dead-letter stream (the trainer then leaves it out instead of waiting for it).
CREATE TABLE group_rewards (
    group_id          text PRIMARY KEY REFERENCES trajectory_groups (id) ON DELETE CASCADE,
    judge_model       text NOT NULL,
    rubric            text,
    error             text,                      -- why the group could not be scored, or NULL
    attempts          integer NOT NULL,          -- judge calls made
    prompt_tokens     integer NOT NULL DEFAULT 0,
    completion_tokens integer NOT NULL DEFAULT 0,
    cost_usd          double precision,          -- NULL when the provider's price is unknown
    scored_at         timestamptz NOT NULL DEFAULT now()
);

-- One row per trajectory of a scored group. ``reward`` is what the trainer uses; the agent's own
-- reward is kept beside the judge's score.
CREATE TABLE trajectory_rewards (
    group_id           text NOT NULL REFERENCES group_rewards (group_id) ON DELETE CASCADE,
    idx                integer NOT NULL,
    reward             double precision NOT NULL,
    judge_score        double precision NOT NULL,
    independent_reward double precision NOT NULL,
    explanation        text NOT NULL,
    PRIMARY KEY (group_id, idx)
);
