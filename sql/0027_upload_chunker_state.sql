-- The chunker state a resumable (tus) upload carries from one PATCH to the next
-- (docs/resumable.md, src/cas/pdf/resume.rs): empty in rows written before it existed
-- (FastCDC), else a tag and, for the PDF-aware chunker, its scanner, queued events and
-- region (at most 73 KiB with a full event queue). The PDF-aware chunker's staged tail is
-- longer than FastCDC's: less than its largest block plus its lookahead (256 KiB + 16 KiB
-- + 16 bytes).
ALTER TABLE tus_uploads ADD COLUMN IF NOT EXISTS chunker bytea NOT NULL DEFAULT '\x';
ALTER TABLE tus_uploads ADD CONSTRAINT tus_uploads_chunker CHECK (octet_length(chunker) <= 81920);
ALTER TABLE tus_uploads DROP CONSTRAINT IF EXISTS tus_uploads_tail;
ALTER TABLE tus_uploads ADD CONSTRAINT tus_uploads_tail CHECK (octet_length(tail) <= 294912);
