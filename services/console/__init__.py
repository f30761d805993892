"""The web console: projects, models, reward curves, trajectories, dead letters and replicas,
read from PostgreSQL and NATS, live through Server-Sent Events fed by NATS subscriptions."""
