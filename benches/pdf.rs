//! Dedup of PDF revisions: PDF-aware ingest against FastCDC.
//!
//! ```text
//! python3 scripts/pdf-corpus.py target/pdf-corpus     # real tools: reportlab, pikepdf, pypdf
//! cargo bench --bench pdf [-- DIR]                    # DIR defaults to target/pdf-corpus
//! ```
//!
//! For each pair of `pairs.tsv` (case, revision N, revision N+1) it stores revision N,
//! then counts the fresh bytes of revision N+1 (blocks not stored before, each counted
//! once) with each chunker, at the same target size (64 KiB), and prints their ratio.
//! Throughput: the cut plus the BLAKE3 of every block (what the ingest's chunk thread and
//! block hashing do per byte), both cutting the file in memory with no copy into a chunker
//! buffer (the ingest copies into either chunker's buffer alike; an earlier version of
//! this benchmark charged the copy to the PDF-aware side only, about 20 % of its cycles),
//! over every file of the corpus, in 9 interleaved rounds
//! (FastCDC, PDF-aware, FastCDC, …): the median of each, and the median of the per-round
//! ratios PDF-aware / FastCDC.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Instant;

use graviton::cas::chunker;
use graviton::cas::pdf::chunk::{PdfSizes, chunk_lengths};

fn blocks(data: &[u8], pdf: bool) -> Vec<(blake3::Hash, usize)> {
    let lengths = if pdf {
        chunk_lengths(data, PdfSizes::default()).0
    } else {
        chunker::chunk_lengths(data)
    };
    let mut at = 0;
    lengths
        .into_iter()
        .map(|len| {
            at += len;
            (blake3::hash(&data[at - len..at]), len)
        })
        .collect()
}

fn fresh_bytes(old: &[u8], new: &[u8], pdf: bool) -> (u64, usize, usize) {
    let mut seen: HashSet<blake3::Hash> = blocks(old, pdf).into_iter().map(|b| b.0).collect();
    let new_blocks = blocks(new, pdf);
    let total = new_blocks.len();
    let mut fresh = 0u64;
    let mut fresh_blocks = 0;
    for (key, len) in new_blocks {
        if seen.insert(key) {
            fresh += len as u64;
            fresh_blocks += 1;
        }
    }
    (fresh, fresh_blocks, total)
}

/// MB/s of one round over every file.
fn round(files: &[Vec<u8>], pdf: bool) -> f64 {
    let bytes: usize = files.iter().map(Vec::len).sum();
    let started = Instant::now();
    for file in files {
        std::hint::black_box(blocks(file, pdf));
    }
    bytes as f64 / started.elapsed().as_secs_f64() / 1e6
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Interleaved rounds (FastCDC, then PDF-aware, `ROUNDS` times, so both see the same
/// machine noise): the median throughput of each and the median of the per-round ratios.
fn throughput(files: &[Vec<u8>]) -> (f64, f64, f64) {
    const ROUNDS: usize = 9;
    let (mut fast, mut pdf, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let f = round(files, false);
        let p = round(files, true);
        fast.push(f);
        pdf.push(p);
        ratio.push(p / f);
    }
    (median(fast), median(pdf), median(ratio))
}

fn main() {
    let dir = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target/pdf-corpus"));
    let pairs = std::fs::read_to_string(dir.join("pairs.tsv")).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; build the corpus first: python3 scripts/pdf-corpus.py {}",
            dir.join("pairs.tsv").display(),
            dir.display()
        )
    });
    let read = |name: &str| std::fs::read(dir.join(name)).expect("corpus file");
    println!(
        "{:<34} {:>9} {:>17} {:>17} {:>6}",
        "case (N -> N+1)", "size N+1", "fresh FastCDC", "fresh PDF-aware", "ratio"
    );
    let mut files = Vec::new();
    for line in pairs.lines().filter(|l| !l.trim().is_empty()) {
        let cols: Vec<&str> = line.split('\t').collect();
        let (case, old, new) = (cols[0], read(cols[1]), read(cols[2]));
        let (generic, gb, gt) = fresh_bytes(&old, &new, false);
        let (pdf, pb, pt) = fresh_bytes(&old, &new, true);
        println!(
            "{case:<34} {:>9} {:>9} ({gb:>2}/{gt:>2}) {:>9} ({pb:>2}/{pt:>2}) {:>6.2}",
            new.len(),
            generic,
            pdf,
            pdf as f64 / generic.max(1) as f64
        );
        files.push(old);
        files.push(new);
    }
    let (fast, pdf, ratio) = throughput(&files);
    println!(
        "throughput (cut + BLAKE3 of blocks, median of 9 interleaved rounds): FastCDC {fast:.0} MB/s, PDF-aware {pdf:.0} MB/s, ratio {ratio:.2}"
    );
}
