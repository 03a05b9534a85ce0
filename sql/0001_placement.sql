-- Placement of upload sessions: cluster meta, node membership, shard assignments.
-- No upload bytes, hot state, tenant or session identifiers are stored here.

-- One row: the shard count fixed at bootstrap and the shard manager's term.
CREATE TABLE placement_meta (
    id              smallint    PRIMARY KEY CHECK (id = 1),
    shard_count     integer     NOT NULL CHECK (shard_count BETWEEN 1 AND 65536),
    manager_term    bigint      NOT NULL DEFAULT 0 CHECK (manager_term >= 0),
    manager_node    text,
    term_started_at timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now()
);

-- Nodes heartbeat their own row; heartbeat_at is always the database server's now().
CREATE TABLE placement_nodes (
    id            text        PRIMARY KEY CHECK (length(id) BETWEEN 1 AND 128),
    public_addr   text        NOT NULL DEFAULT '',
    internal_addr text        NOT NULL DEFAULT '',
    control_addr  text        NOT NULL DEFAULT '',
    version       text        NOT NULL CHECK (length(version) BETWEEN 1 AND 64),
    state         text        NOT NULL CHECK (state IN ('joining', 'active', 'draining', 'dead')),
    incarnation   bigint      NOT NULL DEFAULT 1 CHECK (incarnation >= 1),
    registered_at timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now()
);

-- One row per shard, created at bootstrap. epoch grows by one on every move.
-- moving_to set = a revocation in progress; revoke_acked = the owner stopped ingesting.
CREATE TABLE placement_shards (
    shard        integer     PRIMARY KEY CHECK (shard >= 0),
    node_id      text        REFERENCES placement_nodes (id),
    epoch        bigint      NOT NULL DEFAULT 0 CHECK (epoch >= 0),
    moving_to    text        REFERENCES placement_nodes (id),
    revoke_acked boolean     NOT NULL DEFAULT false,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    CHECK (moving_to IS NULL OR node_id IS NOT NULL),
    CHECK (NOT revoke_acked OR moving_to IS NOT NULL)
);

CREATE INDEX placement_shards_node ON placement_shards (node_id);
