"""The checkpoint publisher: adapters into the Object Store, PostgreSQL and checkpoint.published."""
