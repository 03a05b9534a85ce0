-- Which creation of an upload id a row is: a random number chosen when the upload is
-- created (docs/resumable.md). A PATCH names the generation and offset it read, so an
-- upload terminated or expired and created again under the same id never takes the
-- block list or the whole-content hash state of the one before it (invariant CAS-7).
-- Rows written before this migration read as generation 0.
ALTER TABLE tus_uploads ADD COLUMN IF NOT EXISTS generation bigint NOT NULL DEFAULT 0;
