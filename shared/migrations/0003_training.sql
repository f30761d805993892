-- One row per completed training step, keyed on the TrainRequested event id: a redelivered
-- request finds its row and is answered again instead of training twice.
CREATE TABLE training_steps (
    request_id   text PRIMARY KEY,
    project      text NOT NULL,
    model        text NOT NULL,
    step         integer NOT NULL,
    group_ids    text[] NOT NULL,
    trained      boolean NOT NULL,
    metrics      jsonb NOT NULL,
    completed_at timestamptz NOT NULL DEFAULT now(),
    UNIQUE (project, model, step)
);
