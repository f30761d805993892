-- Ids are chosen by agents, so they are unique only within a tenant: two projects (or two models
-- of one project) may both submit a group, or a train request, called "episode-17". Every key
-- an agent's id takes part in is therefore (project, model, id); keyed on the id alone, the
-- first tenant to use an id silently kept another's group out.
--
-- Stored exactly as sent: agent-written documents are `json` (the text, verbatim) rather than
-- `jsonb`, which cannot hold U+0000 (a model can sample it) and had it replaced.
-- `body_sha256` (of the message as published) tells a redelivery, stored once, from another
-- group under the same id, which is dead-lettered as a conflict.

ALTER TABLE trajectory_rewards DROP CONSTRAINT trajectory_rewards_group_id_fkey;
ALTER TABLE group_rewards DROP CONSTRAINT group_rewards_group_id_fkey;
ALTER TABLE trajectories DROP CONSTRAINT trajectories_group_id_fkey;

ALTER TABLE trajectories ADD COLUMN project text, ADD COLUMN model text;
UPDATE trajectories t SET project = g.project, model = g.model
    FROM trajectory_groups g WHERE g.id = t.group_id;
ALTER TABLE group_rewards ADD COLUMN project text, ADD COLUMN model text;
UPDATE group_rewards r SET project = g.project, model = g.model
    FROM trajectory_groups g WHERE g.id = r.group_id;
ALTER TABLE trajectory_rewards ADD COLUMN project text, ADD COLUMN model text;
UPDATE trajectory_rewards t SET project = r.project, model = r.model
    FROM group_rewards r WHERE r.group_id = t.group_id;

ALTER TABLE trajectories ALTER COLUMN project SET NOT NULL, ALTER COLUMN model SET NOT NULL;
ALTER TABLE group_rewards ALTER COLUMN project SET NOT NULL, ALTER COLUMN model SET NOT NULL;
ALTER TABLE trajectory_rewards ALTER COLUMN project SET NOT NULL, ALTER COLUMN model SET NOT NULL;

ALTER TABLE trajectory_groups DROP CONSTRAINT trajectory_groups_pkey,
    ADD PRIMARY KEY (project, model, id),
    ADD COLUMN body_sha256 text,   -- NULL for groups stored before this migration
    ALTER COLUMN metadata TYPE json USING metadata::json,
    ALTER COLUMN metrics TYPE json USING metrics::json,
    ALTER COLUMN exceptions TYPE json USING exceptions::json,
    ALTER COLUMN logs TYPE json USING logs::json,
    ALTER COLUMN reward_spec TYPE json USING reward_spec::json;
ALTER TABLE trajectories DROP CONSTRAINT trajectories_pkey,
    ADD PRIMARY KEY (project, model, group_id, idx),
    ADD FOREIGN KEY (project, model, group_id)
        REFERENCES trajectory_groups (project, model, id) ON DELETE CASCADE,
    ALTER COLUMN body TYPE json USING body::json;
ALTER TABLE group_rewards DROP CONSTRAINT group_rewards_pkey,
    ADD PRIMARY KEY (project, model, group_id),
    ADD FOREIGN KEY (project, model, group_id)
        REFERENCES trajectory_groups (project, model, id) ON DELETE CASCADE;
ALTER TABLE trajectory_rewards DROP CONSTRAINT trajectory_rewards_pkey,
    ADD PRIMARY KEY (project, model, group_id, idx),
    ADD FOREIGN KEY (project, model, group_id)
        REFERENCES group_rewards (project, model, group_id) ON DELETE CASCADE;

-- A train request's id is the agent's too.
ALTER TABLE training_steps DROP CONSTRAINT training_steps_pkey,
    ADD PRIMARY KEY (project, model, request_id);
