-- Blob manifests, so that every node of a cluster can serve every blob: one row per blob
-- key, inserted once (INSERT ... ON CONFLICT DO NOTHING) and never updated.
--
-- Representation of the ordered block list: `block_keys` is the concatenation of the
-- 32-byte BLAKE3 block keys in blob order and `block_sizes` the matching block sizes.
-- Compared with JSONB (64 hex characters plus quoting and a size per block, ~90 bytes) or
-- a bytea[] (a 4-byte header per element), this costs 36 bytes per block and decodes
-- without parsing, while staying queryable in SQL: block i (0-based) is
-- `substring(block_keys FROM 32 * i + 1 FOR 32)` with size `block_sizes[i + 1]`, e.g.
--   SELECT i, substring(block_keys FROM 32 * i + 1 FOR 32), block_sizes[i + 1]
--   FROM manifests, generate_series(0, block_count - 1) AS i WHERE ...
-- The store checks on every read that the lengths agree and that the sizes add up to
-- blob_size (Manifest::validate); a sum cannot be checked here (no subqueries in CHECK).
CREATE TABLE manifests (
    blob_hash       bytea       NOT NULL,
    blob_size       bigint      NOT NULL,
    -- Manifest format version (Manifest::format).
    format          integer     NOT NULL,
    -- When the row was inserted, by the database clock (operations, age queries).
    created_at      timestamptz NOT NULL DEFAULT now(),
    -- The manifest's own created_at_ms as its first writer set it, kept so that a read
    -- returns exactly the manifest that was written.
    created_at_ms   bigint      NOT NULL,
    -- The chunking that produced the blocks (informational; reads do not depend on it).
    chunk_algorithm text        NOT NULL,
    chunk_min       integer     NOT NULL,
    chunk_avg       integer     NOT NULL,
    chunk_max       integer     NOT NULL,
    block_count     integer     NOT NULL,
    block_keys      bytea       NOT NULL,
    block_sizes     integer[]   NOT NULL,
    CONSTRAINT manifests_pkey PRIMARY KEY (blob_hash, blob_size),
    CONSTRAINT manifests_hash_len CHECK (octet_length(blob_hash) = 32),
    CONSTRAINT manifests_size_nonneg CHECK (blob_size >= 0),
    CONSTRAINT manifests_format_pos CHECK (format >= 1),
    CONSTRAINT manifests_created_nonneg CHECK (created_at_ms >= 0),
    CONSTRAINT manifests_chunking_nonneg CHECK (chunk_min >= 0 AND chunk_avg >= 0 AND chunk_max >= 0),
    CONSTRAINT manifests_block_count CHECK (block_count >= 0),
    CONSTRAINT manifests_block_keys_len CHECK (octet_length(block_keys) = 32 * block_count),
    CONSTRAINT manifests_block_sizes_len CHECK (cardinality(block_sizes) = block_count),
    CONSTRAINT manifests_block_sizes_pos CHECK (0 < ALL (block_sizes))
);

-- Block keys are hashes and do not compress: store them out of line without trying.
ALTER TABLE manifests ALTER COLUMN block_keys SET STORAGE EXTERNAL;
