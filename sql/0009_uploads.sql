-- The ledger of resumable (tus) uploads in a cluster (docs/resumable.md). The
-- single-node ledger keeps the same rows in redb (src/upload/ledger/redb.rs).
--
-- One row per upload: the declared length, the offset durably accepted (committed
-- blocks plus the staged tail), the expiry (unix ms, the owner's clock), the staged tail
-- (the bytes after the last cut point: at most one maximum chunk, 256 KiB, kept in the
-- row so that it moves atomically with the offset), and the blob key once complete.
-- The ordered blocks so far are rows of their own, appended per PATCH.

CREATE TABLE tus_uploads (
    upload_id     text    NOT NULL,
    length        bigint  NOT NULL,
    upload_offset bigint  NOT NULL DEFAULT 0,
    expires_ms    bigint  NOT NULL,
    created_ms    bigint  NOT NULL,
    metadata      text,
    tail          bytea   NOT NULL DEFAULT '\x',
    block_count   bigint  NOT NULL DEFAULT 0,
    blob_key      text,
    CONSTRAINT tus_uploads_pkey PRIMARY KEY (upload_id),
    CONSTRAINT tus_uploads_offset CHECK (upload_offset >= 0 AND upload_offset <= length),
    CONSTRAINT tus_uploads_tail CHECK (octet_length(tail) <= 262144)
);

CREATE INDEX tus_uploads_expires ON tus_uploads (expires_ms);

CREATE TABLE tus_upload_blocks (
    upload_id  text    NOT NULL REFERENCES tus_uploads (upload_id) ON DELETE CASCADE,
    seq        bigint  NOT NULL,
    block_hash bytea   NOT NULL,
    len        integer NOT NULL,
    CONSTRAINT tus_upload_blocks_pkey PRIMARY KEY (upload_id, seq),
    CONSTRAINT tus_upload_blocks_hash_len CHECK (octet_length(block_hash) = 32)
);
