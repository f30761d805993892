-- Least-privilege roles, one per service, plus a read-only one. They are NOLOGIN groups: give a
-- login role membership, e.g. CREATE ROLE collector LOGIN PASSWORD '...' IN ROLE artery_collector.
-- No service role may DROP (only the owner, who runs migrations, may) or DELETE anything.
--
-- Roles belong to the cluster, not to this database: creating one is skipped when it exists
-- (another database's migration made it, maybe at this very moment) and when the user running
-- the migration may not create roles (a managed PostgreSQL): the grants below are then skipped
-- for the missing roles, with a NOTICE, and nothing fails. Grants are idempotent.

DO $$
DECLARE
    role_name text;
    may_create boolean;
BEGIN
    SELECT rolsuper OR rolcreaterole INTO may_create FROM pg_roles WHERE rolname = current_user;
    FOREACH role_name IN ARRAY ARRAY[
        'artery_collector', 'artery_reward', 'artery_trainer', 'artery_publisher', 'artery_reader'
    ] LOOP
        CONTINUE WHEN EXISTS (SELECT 1 FROM pg_roles WHERE rolname = role_name);
        IF NOT may_create THEN
            RAISE NOTICE 'role % does not exist and % may not create it: skipped', role_name, current_user;
            CONTINUE;
        END IF;
        BEGIN
            EXECUTE format('CREATE ROLE %I NOLOGIN', role_name);
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;  -- created concurrently by a migration of another database
        END;
    END LOOP;
END
$$;

DO $$
DECLARE
    grant_row record;
BEGIN
    FOR grant_row IN
        SELECT * FROM (VALUES
            -- the collector: stores groups exactly once (INSERT ... ON CONFLICT DO NOTHING, COPY)
            ('artery_collector', 'SELECT, INSERT', 'models'),
            ('artery_collector', 'SELECT, INSERT', 'trajectory_groups'),
            ('artery_collector', 'SELECT, INSERT', 'trajectories'),
            -- the reward service: reads groups, writes its verdicts
            ('artery_reward', 'SELECT', 'models'),
            ('artery_reward', 'SELECT', 'trajectory_groups'),
            ('artery_reward', 'SELECT', 'trajectories'),
            ('artery_reward', 'SELECT, INSERT', 'group_rewards'),
            ('artery_reward', 'SELECT, INSERT', 'trajectory_rewards'),
            -- the trainer: reads groups and rewards, records its steps
            ('artery_trainer', 'SELECT', 'models'),
            ('artery_trainer', 'SELECT', 'trajectory_groups'),
            ('artery_trainer', 'SELECT', 'trajectories'),
            ('artery_trainer', 'SELECT', 'group_rewards'),
            ('artery_trainer', 'SELECT', 'trajectory_rewards'),
            ('artery_trainer', 'SELECT, INSERT', 'training_steps'),
            -- the publisher: records adapters, marks them published and deleted (an UPDATE)
            ('artery_publisher', 'SELECT, INSERT, UPDATE', 'models'),
            ('artery_publisher', 'SELECT, INSERT, UPDATE', 'checkpoints'),
            -- dashboards, notebooks, artery status
            ('artery_reader', 'SELECT', 'models'),
            ('artery_reader', 'SELECT', 'trajectory_groups'),
            ('artery_reader', 'SELECT', 'trajectories'),
            ('artery_reader', 'SELECT', 'group_rewards'),
            ('artery_reader', 'SELECT', 'trajectory_rewards'),
            ('artery_reader', 'SELECT', 'checkpoints'),
            ('artery_reader', 'SELECT', 'training_steps'),
            -- every service checks which migrations are applied when it starts
            ('artery_collector', 'SELECT', 'schema_migrations'),
            ('artery_reward', 'SELECT', 'schema_migrations'),
            ('artery_trainer', 'SELECT', 'schema_migrations'),
            ('artery_publisher', 'SELECT', 'schema_migrations'),
            ('artery_reader', 'SELECT', 'schema_migrations')
        ) AS g (role_name, privileges, table_name)
    LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = grant_row.role_name) THEN
            RAISE NOTICE 'role % is missing: grants skipped', grant_row.role_name;
        ELSIF to_regclass(grant_row.table_name) IS NULL THEN
            RAISE NOTICE 'table % is missing: grant to % skipped', grant_row.table_name, grant_row.role_name;
        ELSE
            EXECUTE format('GRANT %s ON TABLE %I TO %I',
                           grant_row.privileges, grant_row.table_name, grant_row.role_name);
        END IF;
    END LOOP;
END
$$;
