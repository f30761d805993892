-- The queryable record of what agents submitted. Every row is keyed on an event id, so a
-- redelivered message never writes twice (INSERT ... ON CONFLICT DO NOTHING).

CREATE TABLE models (
    project     text NOT NULL,
    name        text NOT NULL,
    base_model  text,
    config      jsonb NOT NULL DEFAULT '{}'::jsonb,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (project, name)
);

CREATE TABLE trajectory_groups (
    id               text PRIMARY KEY,          -- the TrajectoryGroupSubmitted event id
    project          text NOT NULL,
    model            text NOT NULL,
    step             integer,                   -- policy version the agent sampled with
    split            text NOT NULL,
    num_trajectories integer NOT NULL,
    num_exceptions   integer NOT NULL,
    reward_mean      double precision NOT NULL,
    needs_reward     boolean NOT NULL,
    submitted_at     timestamptz NOT NULL,      -- the event's time
    stored_at        timestamptz NOT NULL DEFAULT now(),
    stream_seq       bigint,                    -- position in the TRAJECTORIES stream
    metadata         jsonb NOT NULL,
    metrics          jsonb NOT NULL,
    exceptions       jsonb NOT NULL,
    logs             jsonb NOT NULL,
    reward_spec      jsonb
);
CREATE INDEX trajectory_groups_model_idx ON trajectory_groups (project, model, stored_at);

CREATE TABLE trajectories (
    group_id  text NOT NULL REFERENCES trajectory_groups (id) ON DELETE CASCADE,
    idx       integer NOT NULL,                 -- position in the group
    reward    double precision NOT NULL,
    body      jsonb NOT NULL,                   -- the whole Trajectory, as submitted
    PRIMARY KEY (group_id, idx)
);
