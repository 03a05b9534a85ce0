-- The shared block index of a cluster on S3-compatible storage (docs/storage.md,
-- "Cluster"): every node writes packs to the one bucket and records here where each
-- block lives, so any node finds and deduplicates against blocks another node wrote.
-- The single-node store keeps the same tables in redb (src/storage/pack/index.rs).
--
-- Safety rules the collector and the commit rely on (STO-10):
-- - A block row points at a pack row (foreign key), and a pack's object is deleted only
--   after its row is deleted, which PostgreSQL refuses while any block row names it. So
--   a block row that a commit confirmed (UPDATE ... RETURNING, row locked until the
--   commit) always has its bytes in the bucket.
-- - Times come from the database clock (`now()`), never from a node's clock.

CREATE TABLE pack_packs (
    pack_id     bytea       NOT NULL,
    size        bigint      NOT NULL,
    blocks      integer     NOT NULL,
    sealed_at   timestamptz NOT NULL DEFAULT now(),
    -- Set when no live block is left in the pack; the object is deleted (and the row
    -- with it) after storage.gc.retention.
    retired_at  timestamptz,
    CONSTRAINT pack_packs_pkey PRIMARY KEY (pack_id),
    CONSTRAINT pack_packs_id_len CHECK (octet_length(pack_id) = 32),
    CONSTRAINT pack_packs_size_pos CHECK (size > 0),
    CONSTRAINT pack_packs_blocks_pos CHECK (blocks > 0)
);

CREATE TABLE pack_blocks (
    block_hash     bytea       NOT NULL,
    pack_id        bytea       NOT NULL REFERENCES pack_packs (pack_id),
    -- Offset of the block's data (after its record header) and its length.
    pack_offset    bigint      NOT NULL,
    len            integer     NOT NULL,
    -- The last commit that wrote or deduplicated the block: what the collector's
    -- minimum age (storage.gc.min_age) protects.
    last_ref       timestamptz NOT NULL DEFAULT now(),
    -- Set by the collector (quarantine); a dedup commit clears it again, and the row is
    -- deleted after storage.gc.retention.
    quarantined_at timestamptz,
    CONSTRAINT pack_blocks_pkey PRIMARY KEY (block_hash),
    CONSTRAINT pack_blocks_hash_len CHECK (octet_length(block_hash) = 32),
    CONSTRAINT pack_blocks_offset_nonneg CHECK (pack_offset >= 0),
    CONSTRAINT pack_blocks_len_pos CHECK (len > 0)
);

-- The foreign key's lookups (retire, claim) and the per-pack live bytes.
CREATE INDEX pack_blocks_pack ON pack_blocks (pack_id);
