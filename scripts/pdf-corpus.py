#!/usr/bin/env python3
"""Build the PDF revision corpus of `cargo bench --bench pdf` with real PDF tools.

    pip install reportlab pypdf pikepdf pillow    # PyPI packages
    python3 scripts/pdf-corpus.py target/pdf-corpus

Writes the revisions and `pairs.tsv` (case, revision N, revision N+1) into the directory.
Nothing here is committed; the corpus is deterministic (fixed seeds).
"""
import io
import random
import sys
from pathlib import Path

import pikepdf
from PIL import Image
from pypdf import PdfWriter
from reportlab.lib.pagesizes import A4
from reportlab.lib.utils import ImageReader
from reportlab.pdfgen import canvas

out = Path(sys.argv[1] if len(sys.argv) > 1 else "target/pdf-corpus")
out.mkdir(parents=True, exist_ok=True)
rng = random.Random(27)
WORDS = "ledger quarterly revenue contract clause party signature annex audit margin".split()


def photo(w, h, seed):
    """A photo-like image: smooth gradients plus noise, JPEG-encoded (as a scan or a
    camera picture is), so its stream does not compress further."""
    r = random.Random(seed)
    img = Image.new("RGB", (w, h))
    px = img.load()
    a, b, c = r.random(), r.random(), r.random()
    for y in range(h):
        for x in range(w):
            n = r.randint(-40, 40)
            px[x, y] = (
                int(128 + 100 * a * ((x * 3 + y) % 256) / 256) + n,
                int(128 + 100 * b * ((y * 2) % 256) / 256) + n,
                int(128 + 100 * c * ((x + y * 5) % 256) / 256) + n,
            )
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=85)
    buf.seek(0)
    return ImageReader(buf)


def report(path, pages=48):
    """A multi-page report: text, a table of figures, and a chart image on every 4th page."""
    c = canvas.Canvas(str(path), pagesize=A4, pageCompression=1)
    c.setTitle("Quarterly report")
    for p in range(pages):
        c.setFont("Helvetica-Bold", 16)
        c.drawString(72, 800, f"Section {p + 1}: {rng.choice(WORDS).title()} review")
        c.setFont("Helvetica", 9)
        y = 780
        for line in range(60):
            words = " ".join(rng.choice(WORDS) for _ in range(14))
            c.drawString(72, y, f"{line + 1:02d}. {words} {rng.randint(1000, 99999)}")
            y -= 11
        if p % 4 == 0:
            c.drawImage(photo(360, 240, p), 100, 60, width=300, height=110)
        c.showPage()
    c.save()


def scan(path, pages=12):
    """A scanned-image PDF: one full-page JPEG per page, no text."""
    c = canvas.Canvas(str(path), pagesize=A4)
    for p in range(pages):
        c.drawImage(photo(620, 880, 1000 + p), 0, 0, width=A4[0], height=A4[1])
        c.showPage()
    c.save()


def rewrite(src, dst, edit=None, **save):
    with pikepdf.open(src) as pdf:
        if edit:
            edit(pdf)
        pdf.save(dst, **save)


def set_title(title):
    def edit(pdf):
        pdf.docinfo["/Title"] = title
        pdf.docinfo["/ModDate"] = "D:20261203120000Z"

    return edit


def new_page(path, scanned):
    """A one-page PDF with content that exists in no revision: new text and a new image
    (a new full-page scan for the scanned document)."""
    c = canvas.Canvas(str(path), pagesize=A4, pageCompression=1)
    if scanned:
        c.drawImage(photo(620, 880, 7777), 0, 0, width=A4[0], height=A4[1])
    else:
        c.setFont("Helvetica-Bold", 16)
        c.drawString(72, 800, "Addendum: revised figures")
        c.setFont("Helvetica", 9)
        y = 780
        for line in range(60):
            words = " ".join(rng.choice(WORDS) for _ in range(14))
            c.drawString(72, y, f"A{line + 1:02d}. {words} {rng.randint(1000, 99999)}")
            y -= 11
        c.drawImage(photo(360, 240, 4242), 100, 60, width=300, height=110)
    c.showPage()
    c.save()


def insert_middle(scanned):
    """Insert a page with new stream data (not a copy of an existing page) in the
    middle; the whole file is rewritten (objects renumbered)."""
    page_file = out / ("new-scan-page.pdf" if scanned else "new-report-page.pdf")
    new_page(page_file, scanned)

    def edit(pdf):
        with pikepdf.open(page_file) as donor:
            pdf.pages.insert(len(pdf.pages) // 2, donor.pages[0])

    return edit


def remove_near_start(pdf):
    del pdf.pages[2]


def incremental(src, dst):
    writer = PdfWriter(str(src), incremental=True)
    writer.add_metadata({"/Title": "Quarterly report (approved)", "/Approver": "J. Doe"})
    with open(dst, "wb") as f:
        writer.write(f)


r0 = out / "report.pdf"
report(r0)
incremental(r0, out / "report-incremental.pdf")
rewrite(r0, out / "report-metadata-rewrite.pdf", set_title("Quarterly report v2"))
rewrite(r0, out / "report-page-inserted.pdf", insert_middle(False))
rewrite(r0, out / "report-page-removed.pdf", remove_near_start)
rewrite(r0, out / "report-objstm-on.pdf", object_stream_mode=pikepdf.ObjectStreamMode.generate)
rewrite(out / "report-objstm-on.pdf", out / "report-objstm-off.pdf",
        object_stream_mode=pikepdf.ObjectStreamMode.disable)
rewrite(r0, out / "report-linearized.pdf", linearize=True)
s0 = out / "scan.pdf"
scan(s0)
rewrite(s0, out / "scan-metadata-rewrite.pdf", set_title("Scan, indexed"))
rewrite(s0, out / "scan-page-inserted.pdf", insert_middle(True))

pairs = [
    ("incremental update", "report.pdf", "report-incremental.pdf"),
    ("metadata changed, full rewrite", "report.pdf", "report-metadata-rewrite.pdf"),
    ("page inserted in the middle", "report.pdf", "report-page-inserted.pdf"),
    ("page removed near the start", "report.pdf", "report-page-removed.pdf"),
    ("object streams on (renumbered)", "report.pdf", "report-objstm-on.pdf"),
    ("object streams off again", "report-objstm-on.pdf", "report-objstm-off.pdf"),
    ("linearized (reordered)", "report.pdf", "report-linearized.pdf"),
    ("scan: metadata rewrite", "scan.pdf", "scan-metadata-rewrite.pdf"),
    ("scan: page inserted", "scan.pdf", "scan-page-inserted.pdf"),
]
with open(out / "pairs.tsv", "w") as f:
    for case, a, b in pairs:
        f.write(f"{case}\t{a}\t{b}\n")
for p in sorted(out.glob("*.pdf")):
    if p.name.startswith("new-"):
        continue
    print(f"{p.name}\t{p.stat().st_size}")
