"""The store: the only writer of the database, the source of truth and the only GPU allocator."""
