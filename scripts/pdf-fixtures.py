#!/usr/bin/env python3
"""Make the small real PDFs under tests/fixtures/pdf/ (committed, a few KB each), used by
`cas::pdf::tests::real_pdfs_*`. Tools: reportlab, pikepdf (qpdf). Re-run to refresh.

    python3 scripts/pdf-fixtures.py tests/fixtures/pdf
"""
import sys
from pathlib import Path

import pikepdf
from reportlab.pdfgen import canvas

out = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/pdf")
out.mkdir(parents=True, exist_ok=True)
base = out / "plain.pdf"
c = canvas.Canvas(str(base), pageCompression=0)
for p in range(3):
    c.drawString(72, 720, f"Fixture page {p + 1} (endobj) stream \\( nested ( parens ) )")
    c.rect(72, 100 + p * 10, 200, 300)
    c.showPage()
c.save()
with pikepdf.open(base) as pdf:
    pdf.save(out / "linearized.pdf", linearize=True)
    pdf.save(out / "objstm.pdf", object_stream_mode=pikepdf.ObjectStreamMode.generate)
    pdf.save(out / "encrypted.pdf", encryption=pikepdf.Encryption(owner="o", user="u", R=6))
    pdf.save(out / "pdf20.pdf", force_version="2.0")
with pikepdf.open(base) as pdf:
    pdf.docinfo["/Title"] = "incremental"
    pdf.save(out / "rewritten.pdf")
for p in sorted(out.glob("*.pdf")):
    print(p.name, p.stat().st_size)

# A scanned-style document large enough that a resumable upload's PATCHes end inside
# image streams, between objects and inside page contents (cas::pdf::tests resume
# tests, tests/pdf_tus.rs): three pages of noisy JPEG photos (about 200 KB each, which do
# not compress further) and a text page, uncompressed page contents.
import io
import random

from PIL import Image
from reportlab.lib.utils import ImageReader

rng = random.Random(2027)
scan = out / "scanned.pdf"
c = canvas.Canvas(str(scan), pageCompression=0)
for p in range(3):
    img = Image.new("RGB", (420, 420))
    img.putdata([(rng.randrange(256), rng.randrange(256), rng.randrange(256)) for _ in range(420 * 420)])
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=70)
    buf.seek(0)
    c.drawImage(ImageReader(buf), 50, 200, 500, 500)
    c.drawString(72, 760, f"Scanned page {p + 1}")
    c.showPage()
for line in range(40):
    c.drawString(72, 760 - line * 18, " ".join(rng.choice(["ledger", "annex", "clause", "(endobj)", "stream"]) for _ in range(8)))
c.showPage()
c.save()
print(scan.name, scan.stat().st_size)
