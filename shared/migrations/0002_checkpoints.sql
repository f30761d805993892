-- Published LoRA adapters, one row per (project, model, step), written by the publisher.
-- The row is keyed on the checkpoint.saved event id too, so a redelivery never writes twice.
-- The adapter itself lives in the Object Store under object_name; deleted_at is set once
-- retention has removed it from there (the row stays, with its metrics, as the record).

CREATE TABLE checkpoints (
    project         text NOT NULL,
    model           text NOT NULL,
    step            integer NOT NULL,
    event_id        text NOT NULL UNIQUE,       -- the CheckpointSaved event id
    object_name     text NOT NULL,              -- key in the adapter Object Store
    sha256          text NOT NULL,
    size_bytes      bigint NOT NULL,
    base_model      text NOT NULL,
    metrics         jsonb NOT NULL,             -- the step's metrics, as the trainer reported them
    saved_at        timestamptz NOT NULL,       -- the checkpoint.saved event's time
    stored_at       timestamptz NOT NULL DEFAULT now(),
    published_at    timestamptz,                -- checkpoint.published sent
    deleted_at      timestamptz,                -- removed from the Object Store, checkpoint.deleted sent
    deleted_reason  text,
    PRIMARY KEY (project, model, step)
);
CREATE INDEX checkpoints_live_idx ON checkpoints (project, model, step) WHERE deleted_at IS NULL;
