//! A streaming scanner of PDF syntax that reports where objects and stream data begin
//! and end, fed with arbitrary pieces of a body.
//!
//! It is a byte-level state machine whose whole state is this struct (a few dozen bytes:
//! no buffer of the input), so feeding a body in any split reports the same events at the
//! same absolute offsets (CAS-10). It never panics and never rejects: on input it does not
//! understand it keeps scanning and notes the first [`Unsupported`] structure, which the
//! caller may refuse (`[ingest.pdf] unsupported = "reject"`).
//!
//! What it recognises (ISO 32000-2, section 7):
//! - comments `%` to the end of the line, including the `%PDF-x.y` header and `%%EOF`
//!   (a revision end is reported after the end of line of each `%%EOF`, so every
//!   incremental update starts a block);
//! - indirect objects `N G obj … endobj` (a boundary at the first digit of `N`);
//! - literal strings with backslash escapes and nested parentheses, hex strings,
//!   dictionaries, arrays and names, so that `endobj` or `stream` inside a string or a
//!   comment is not taken for a keyword;
//! - streams: the `/Length` of the object's own dictionary when it is a direct integer,
//!   checked by finding `endstream` right after that many bytes (after an optional end of
//!   line); when `/Length` is indirect (`12 0 R`), missing or wrong, the data ends at the
//!   first `endstream` (the end of line before it is not data);
//! - cross-reference tables (a boundary at `xref`), trailers, `startxref`; cross-reference
//!   streams and object streams (`/ObjStm`) are streams like any other, and a linearized
//!   file is a sequence of objects like any other.
//!
//! Encrypted files keep this syntax (only string and stream contents are encrypted).

/// Something the scanner found, at an absolute offset into the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A place between two top-level structures: the start of an `N G obj` header or of
    /// an `xref` table.
    Boundary(u64),
    /// The end of a revision: the byte after the end of line that follows `%%EOF` (an
    /// incremental update appends its objects there).
    Revision(u64),
    /// The first byte of a stream's data (after `stream` and its end of line).
    StreamStart(u64),
    /// The byte after a stream's last data byte (before the end of line and `endstream`).
    StreamEnd(u64),
}

/// Structures the scanner does not handle as PDF (the first one seen is kept).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unsupported {
    /// The body ended inside an object, a string or a stream's data.
    Unterminated,
    /// A stream whose direct `/Length` was not followed by `endstream`: its end was found
    /// by search instead (a `/Length` too small is found exactly; one too large has
    /// skipped past the real end, so the next objects were read as data).
    LengthMismatch,
    /// The body never had an `N G obj` header.
    NoObjects,
}

impl Unsupported {
    pub fn as_str(self) -> &'static str {
        match self {
            Unsupported::Unterminated => "unterminated",
            Unsupported::LengthMismatch => "stream_length_mismatch",
            Unsupported::NoObjects => "no_objects",
        }
    }
}

/// Longest token kept for classification; longer regular-character runs are kept as
/// "long" (never a number or keyword).
const TOKEN_CAP: usize = 24;
const ENDSTREAM: &[u8; 9] = b"endstream";
/// KMP failure function of `endstream` (only the second `e` overlaps the first).
const ENDSTREAM_FAIL: [u8; 9] = [0, 0, 0, 0, 0, 0, 1, 0, 0];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Tokens: top level or inside an object.
    Normal,
    /// In a comment; `eof_matched` counts the bytes of `%%EOF` matched from its start
    /// (6 = it was `%%EOF`, so far followed only by spaces).
    Comment {
        eof_matched: u8,
    },
    /// A `%%EOF` line ended with CR: an LF may follow before the boundary.
    EofCr,
    LitString {
        depth: u32,
        escape: bool,
    },
    HexString,
    /// Just after the keyword `stream`: its end of line (`cr`: a CR was seen).
    AfterStream {
        cr: bool,
        length: Option<u64>,
    },
    /// Inside data of a declared direct length: `left` bytes to skip.
    Data {
        left: u64,
        end: u64,
    },
    /// After the declared data: an optional EOL (`eol`: bytes of it seen), then
    /// `endstream` (`matched` bytes of it seen).
    Verify {
        end: u64,
        eol: u8,
        matched: u8,
    },
    /// Searching `endstream` (`matched` bytes of it seen, starting at `at`); `data` is
    /// where the stream's data began and `eol` the end-of-line bytes before `at`.
    Search {
        data: u64,
        matched: u8,
        at: u64,
        eol: u8,
    },
}

/// Where the value of `/Length` in the object's dictionary stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LengthState {
    None,
    /// The key `/Length` was the last token at dictionary depth 1.
    Key,
    /// `/Length n` (may still become `n g R`).
    Num(u64),
    /// `/Length n g`.
    NumNum(u64),
    /// A direct integer.
    Direct(u64),
    /// Indirect or not an integer.
    Unknown,
}

/// The streaming scanner (see the module docs).
#[derive(Debug, Clone)]
pub struct Scanner {
    pos: u64,
    mode: Mode,
    /// Pending `<` or `>` whose meaning depends on the next byte.
    pending: Option<u8>,
    token: [u8; TOKEN_CAP],
    token_len: u8,
    token_long: bool,
    token_start: u64,
    in_token: bool,
    /// The start offsets of the last two integer tokens, when the last tokens were ints.
    ints: [u64; 2],
    int_count: u8,
    in_object: bool,
    depth: u32,
    length: LengthState,
    /// The last two bytes consumed (for the end of line before `endstream`).
    last: [u8; 2],
    objects: u64,
    unsupported: Option<Unsupported>,
    finished: bool,
}

impl Default for Scanner {
    fn default() -> Self {
        Self::new()
    }
}

fn is_white(b: u8) -> bool {
    matches!(b, 0 | b'\t' | b'\n' | 0x0c | b'\r' | b' ')
}

fn is_delim(b: u8) -> bool {
    matches!(
        b,
        b'(' | b')' | b'<' | b'>' | b'[' | b']' | b'{' | b'}' | b'/' | b'%'
    )
}

fn eol_len(last: [u8; 2]) -> u8 {
    match last {
        [b'\r', b'\n'] => 2,
        [_, b'\n'] | [_, b'\r'] => 1,
        _ => 0,
    }
}

impl Scanner {
    pub fn new() -> Self {
        Self {
            pos: 0,
            mode: Mode::Normal,
            pending: None,
            token: [0; TOKEN_CAP],
            token_len: 0,
            token_long: false,
            token_start: 0,
            in_token: false,
            ints: [0; 2],
            int_count: 0,
            in_object: false,
            depth: 0,
            length: LengthState::None,
            last: [0; 2],
            objects: 0,
            unsupported: None,
            finished: false,
        }
    }

    /// Bytes consumed so far.
    pub fn position(&self) -> u64 {
        self.pos
    }

    /// Indirect object headers seen.
    pub fn objects(&self) -> u64 {
        self.objects
    }

    /// The first unsupported structure seen (after [`Self::finish`]: also at the end).
    pub fn unsupported(&self) -> Option<Unsupported> {
        self.unsupported
    }

    fn note(&mut self, what: Unsupported) {
        if self.unsupported.is_none() {
            self.unsupported = Some(what);
        }
    }

    /// The end of the body: notes an unterminated structure or a body without objects.
    pub fn finish(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        let unterminated = match self.mode {
            Mode::Normal | Mode::Comment { .. } | Mode::EofCr => self.in_object,
            _ => true,
        };
        if unterminated {
            self.note(Unsupported::Unterminated);
        }
        if self.objects == 0 {
            self.note(Unsupported::NoObjects);
        }
    }

    /// Consume the next piece of the body, calling `emit` for each event, in offset order.
    pub fn feed(&mut self, data: &[u8], emit: &mut impl FnMut(Event)) {
        let mut i = 0;
        while i < data.len() {
            i += self.step(data, i, emit);
        }
        match data.len() {
            0 => {}
            1 => self.last = [self.last[1], data[0]],
            n => self.last = [data[n - 2], data[n - 1]],
        }
    }

    /// The byte before `data[i]` and the one before it.
    fn last_before(&self, data: &[u8], i: usize) -> [u8; 2] {
        match i {
            0 => self.last,
            1 => [self.last[1], data[0]],
            _ => [data[i - 2], data[i - 1]],
        }
    }

    /// Consume at least one byte of `all[from..]` (non-empty); returns how many.
    fn step(&mut self, all: &[u8], from: usize, emit: &mut impl FnMut(Event)) -> usize {
        let start = self.pos;
        let data = &all[from..];
        let consumed = match self.mode {
            Mode::Data { left, end } => {
                let take = (left.min(data.len() as u64)) as usize;
                let left = left - take as u64;
                self.mode = if left == 0 {
                    Mode::Verify {
                        end,
                        eol: 0,
                        matched: 0,
                    }
                } else {
                    Mode::Data { left, end }
                };
                take.max(1).min(data.len())
            }
            Mode::Search {
                data: begin,
                matched: 0,
                ..
            } => match memchr::memchr(b'e', data) {
                None => data.len(),
                Some(k) => {
                    let eol = eol_len(self.last_before(all, from + k));
                    self.mode = Mode::Search {
                        data: begin,
                        matched: 1,
                        at: start + k as u64,
                        eol,
                    };
                    k + 1
                }
            },
            Mode::Comment { eof_matched } if eof_matched == 0 || eof_matched == 7 => {
                // The body of a comment that is not (or no longer can be) `%%EOF`.
                match memchr::memchr2(b'\n', b'\r', data) {
                    None => data.len(),
                    Some(k) => {
                        self.pos += k as u64;
                        self.byte(data[k], all, from + k, emit);
                        k + 1
                    }
                }
            }
            Mode::LitString {
                depth: _,
                escape: false,
            } => match memchr::memchr3(b'\\', b'(', b')', data) {
                None => data.len(),
                Some(k) => {
                    self.pos += k as u64;
                    self.byte(data[k], all, from + k, emit);
                    k + 1
                }
            },
            Mode::HexString => match memchr::memchr(b'>', data) {
                None => data.len(),
                Some(k) => {
                    self.mode = Mode::Normal;
                    k + 1
                }
            },
            _ => {
                self.byte(data[0], all, from, emit);
                1
            }
        };
        // `byte` advanced `pos` by one for the byte it handled; fast paths skip the rest.
        self.pos = start + consumed as u64;
        consumed
    }

    /// Handle one byte `b` (= `data[i]`) at offset `self.pos`.
    fn byte(&mut self, b: u8, data: &[u8], i: usize, emit: &mut impl FnMut(Event)) {
        let at = self.pos;
        match self.mode {
            Mode::Normal => {
                if self.normal(b, at, emit) {
                    self.byte(b, data, i, emit);
                }
            }
            Mode::Comment { eof_matched } => {
                if b == b'\n' || b == b'\r' {
                    if (eof_matched == 5 || eof_matched == 6) && !self.in_object {
                        if b == b'\n' {
                            emit(Event::Revision(at + 1));
                            self.mode = Mode::Normal;
                        } else {
                            self.mode = Mode::EofCr;
                        }
                    } else {
                        self.mode = Mode::Normal;
                    }
                    return;
                }
                let next = match eof_matched {
                    // The comment started with its `%` (counted as 1).
                    1..=4 if b == b"%%EOF"[eof_matched as usize] => eof_matched + 1,
                    5 | 6 if is_white(b) => 6,
                    5 | 6 => 7,
                    0 | 7 => eof_matched,
                    _ => 7,
                };
                self.mode = Mode::Comment { eof_matched: next };
            }
            Mode::EofCr => {
                self.mode = Mode::Normal;
                if b == b'\n' {
                    emit(Event::Revision(at + 1));
                } else {
                    emit(Event::Revision(at));
                    self.byte(b, data, i, emit);
                }
            }
            Mode::LitString { depth, escape } => {
                self.mode = if escape {
                    Mode::LitString {
                        depth,
                        escape: false,
                    }
                } else {
                    match b {
                        b'\\' => Mode::LitString {
                            depth,
                            escape: true,
                        },
                        b'(' => Mode::LitString {
                            depth: depth.saturating_add(1),
                            escape: false,
                        },
                        b')' if depth <= 1 => Mode::Normal,
                        b')' => Mode::LitString {
                            depth: depth - 1,
                            escape: false,
                        },
                        _ => Mode::LitString { depth, escape },
                    }
                };
            }
            Mode::HexString => {
                if b == b'>' {
                    self.mode = Mode::Normal;
                }
            }
            Mode::AfterStream { cr, length } => {
                let data_at = match (cr, b) {
                    (false, b'\r') => {
                        self.mode = Mode::AfterStream { cr: true, length };
                        return;
                    }
                    (_, b'\n') => at + 1,
                    // `stream` then CR alone, or no end of line: the data starts here.
                    _ => at,
                };
                emit(Event::StreamStart(data_at));
                self.mode = match length {
                    Some(0) => Mode::Verify {
                        end: data_at,
                        eol: 0,
                        matched: 0,
                    },
                    Some(n) => Mode::Data {
                        left: n,
                        end: data_at.saturating_add(n),
                    },
                    None => Mode::Search {
                        data: data_at,
                        matched: 0,
                        at: 0,
                        eol: 0,
                    },
                };
                if data_at == at {
                    // This byte is data (or the first byte after empty data).
                    self.byte(b, data, i, emit);
                }
            }
            Mode::Data { left, end } => {
                // The first data byte right after `stream` (the rest takes the fast path).
                self.mode = if left <= 1 {
                    Mode::Verify {
                        end,
                        eol: 0,
                        matched: 0,
                    }
                } else {
                    Mode::Data {
                        left: left - 1,
                        end,
                    }
                };
            }
            Mode::Verify { end, eol, matched } => {
                if matched == 0 && eol < 2 && (b == b'\r' || b == b'\n') {
                    let ok = match (eol, b) {
                        (0, _) => true,
                        (1, b'\n') => self.last_before(data, i)[1] == b'\r',
                        _ => false,
                    };
                    if ok {
                        self.mode = Mode::Verify {
                            end,
                            eol: eol + 1,
                            matched,
                        };
                        return;
                    }
                }
                if b == ENDSTREAM[matched as usize] {
                    if matched as usize + 1 == ENDSTREAM.len() {
                        emit(Event::StreamEnd(end));
                        self.end_stream();
                    } else {
                        self.mode = Mode::Verify {
                            end,
                            eol,
                            matched: matched + 1,
                        };
                    }
                    return;
                }
                // The declared length was wrong: the data ends at the next `endstream`.
                // (A `/Length` too short is found exactly; one too large overran the data,
                // which this scanner cannot take back.)
                self.note(Unsupported::LengthMismatch);
                self.mode = Mode::Search {
                    data: end,
                    matched: 0,
                    at: 0,
                    eol: 0,
                };
                self.byte(b, data, i, emit);
            }
            Mode::Search {
                data: begin,
                matched,
                at: kw,
                eol,
            } => {
                let mut m = matched;
                while m > 0 && b != ENDSTREAM[m as usize] {
                    m = ENDSTREAM_FAIL[m as usize - 1];
                }
                let (m, kw, eol) = if m == 0 {
                    if b == b'e' {
                        (1, at, eol_len(self.last_before(data, i)))
                    } else {
                        (0, kw, eol)
                    }
                } else if m == matched {
                    (m + 1, kw, eol)
                } else {
                    // Fell back onto the second `e` of a partial match: the match now
                    // starts there, after `t` and `r`, so no end of line precedes it.
                    (m + 1, at.saturating_sub(u64::from(m)), 0)
                };
                if m as usize == ENDSTREAM.len() {
                    let end = kw.saturating_sub(u64::from(eol)).max(begin);
                    emit(Event::StreamEnd(end));
                    self.end_stream();
                } else {
                    self.mode = Mode::Search {
                        data: begin,
                        matched: m,
                        at: kw,
                        eol,
                    };
                }
            }
        }
    }

    fn end_stream(&mut self) {
        self.mode = Mode::Normal;
        self.int_count = 0;
        self.length = LengthState::None;
    }

    /// A byte in token mode. Returns true when the byte ended a token that changed the mode
    /// (`stream`): the byte is then handled again in the new mode.
    fn normal(&mut self, b: u8, at: u64, emit: &mut impl FnMut(Event)) -> bool {
        if let Some(p) = self.pending.take() {
            match (p, b) {
                (b'<', b'<') => {
                    self.depth = self.depth.saturating_add(1);
                    self.structural();
                    return false;
                }
                (b'<', _) => {
                    self.structural();
                    // This byte belongs to the hex string (it may be its `>`).
                    self.mode = if b == b'>' {
                        Mode::Normal
                    } else {
                        Mode::HexString
                    };
                    return false;
                }
                (b'>', b'>') => {
                    self.depth = self.depth.saturating_sub(1);
                    self.structural();
                    return false;
                }
                _ => self.structural(),
            }
        }
        if (is_white(b) || is_delim(b)) && self.in_token {
            self.end_token(emit);
            if self.mode != Mode::Normal {
                return true;
            }
        }
        match b {
            b'%' => self.mode = Mode::Comment { eof_matched: 1 },
            b'(' => {
                self.structural();
                self.mode = Mode::LitString {
                    depth: 1,
                    escape: false,
                };
            }
            b'<' | b'>' => self.pending = Some(b),
            b'[' => {
                self.depth = self.depth.saturating_add(1);
                self.structural();
            }
            b']' => {
                self.depth = self.depth.saturating_sub(1);
                self.structural();
            }
            b')' | b'{' | b'}' => self.structural(),
            b'/' => self.start_token(b, at),
            _ if is_white(b) => {}
            _ => {
                if self.in_token {
                    self.push_token(b);
                } else {
                    self.start_token(b, at);
                }
            }
        }
        false
    }

    fn start_token(&mut self, b: u8, at: u64) {
        self.in_token = true;
        self.token_start = at;
        self.token_len = 0;
        self.token_long = false;
        self.push_token(b);
    }

    fn push_token(&mut self, b: u8) {
        if (self.token_len as usize) < TOKEN_CAP {
            self.token[self.token_len as usize] = b;
            self.token_len += 1;
        } else {
            self.token_long = true;
        }
    }

    /// A delimiter that is a value or a structure (not an integer): breaks `N G obj`,
    /// `N G R` and `/Length n`.
    fn structural(&mut self) {
        self.int_count = 0;
        self.length = match self.length {
            LengthState::Num(n) | LengthState::NumNum(n) => LengthState::Direct(n),
            LengthState::Key => LengthState::Unknown,
            other => other,
        };
    }

    fn end_token(&mut self, emit: &mut impl FnMut(Event)) {
        if !self.in_token {
            return;
        }
        self.in_token = false;
        let token = &self.token[..self.token_len as usize];
        let start = self.token_start;
        let long = self.token_long;
        let int = if !long && !token.is_empty() && token.len() <= 19 {
            token.iter().try_fold(0u64, |acc, &d| {
                d.is_ascii_digit().then(|| acc * 10 + u64::from(d - b'0'))
            })
        } else {
            None
        };
        if let Some(n) = int {
            self.ints = [self.ints[1], start];
            self.int_count = (self.int_count + 1).min(2);
            self.length = match self.length {
                LengthState::Key => LengthState::Num(n),
                LengthState::Num(v) => LengthState::NumNum(v),
                LengthState::NumNum(v) => LengthState::Direct(v),
                other => other,
            };
            return;
        }
        let ints = self.int_count;
        self.int_count = 0;
        let keyword: &[u8] = if long { b"" } else { token };
        match keyword {
            b"obj" if ints == 2 => {
                emit(Event::Boundary(self.ints[0]));
                self.objects += 1;
                self.in_object = true;
                self.depth = 0;
                self.length = LengthState::None;
                return;
            }
            b"endobj" => {
                self.in_object = false;
                self.depth = 0;
                self.length = LengthState::None;
                return;
            }
            b"xref" if !self.in_object => {
                emit(Event::Boundary(start));
                return;
            }
            b"stream" => {
                let length = match self.length {
                    LengthState::Num(n) | LengthState::Direct(n) => Some(n),
                    _ => None,
                };
                self.mode = Mode::AfterStream { cr: false, length };
                return;
            }
            _ => {}
        }
        self.length = match self.length {
            LengthState::NumNum(_) if keyword == b"R" => LengthState::Unknown,
            LengthState::Num(n) | LengthState::NumNum(n) => LengthState::Direct(n),
            LengthState::Key => LengthState::Unknown,
            other => other,
        };
        if self.in_object && self.depth == 1 && keyword == b"/Length" {
            self.length = LengthState::Key;
        }
    }
}

/// Every event of a complete body (tests and the benchmark).
pub fn scan_all(data: &[u8]) -> (Vec<Event>, Option<Unsupported>) {
    let mut scanner = Scanner::new();
    let mut events = Vec::new();
    scanner.feed(data, &mut |e| events.push(e));
    scanner.finish();
    (events, scanner.unsupported())
}

/// A saved scanner or chunker state that cannot be read back (damaged or from another
/// version).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("saved PDF chunker state is damaged: {0}")]
pub struct StateError(pub &'static str);

/// Little-endian writer of saved states.
#[derive(Default)]
pub(crate) struct StateWriter(pub Vec<u8>);

impl StateWriter {
    pub fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub fn bool(&mut self, v: bool) {
        self.u8(u8::from(v));
    }
}

/// The reader matching [`StateWriter`]; every read is bounds-checked.
pub(crate) struct StateReader<'a>(pub &'a [u8]);

impl StateReader<'_> {
    pub fn bytes(&mut self, n: usize) -> Result<&[u8], StateError> {
        if self.0.len() < n {
            return Err(StateError("truncated"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    pub fn u8(&mut self) -> Result<u8, StateError> {
        Ok(self.bytes(1)?[0])
    }
    pub fn u32(&mut self) -> Result<u32, StateError> {
        let mut b = [0; 4];
        b.copy_from_slice(self.bytes(4)?);
        Ok(u32::from_le_bytes(b))
    }
    pub fn u64(&mut self) -> Result<u64, StateError> {
        let mut b = [0; 8];
        b.copy_from_slice(self.bytes(8)?);
        Ok(u64::from_le_bytes(b))
    }
    pub fn bool(&mut self) -> Result<bool, StateError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(StateError("bad flag")),
        }
    }
    pub fn end(&self) -> Result<(), StateError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(StateError("trailing bytes"))
        }
    }
}

/// Bytes of a saved [`Scanner`] (fixed: the scanner holds no buffer).
pub const SCANNER_STATE_LEN: usize =
    8 + 18 + 2 + TOKEN_CAP + 1 + 1 + 8 + 1 + 16 + 1 + 1 + 4 + 9 + 2 + 8 + 1 + 1;

impl Scanner {
    /// Save the whole state (for a resumable upload's next part; see
    /// `cas::pdf::resume`). [`Self::restore`] gives back a scanner that reports the same
    /// events for the same following bytes.
    pub(crate) fn save(&self, w: &mut StateWriter) {
        let start = w.0.len();
        w.u64(self.pos);
        // Mode: a tag and two fixed 8-byte fields, and one flag byte.
        let (tag, a, b, c): (u8, u64, u64, u8) = match self.mode {
            Mode::Normal => (0, 0, 0, 0),
            Mode::Comment { eof_matched } => (1, 0, 0, eof_matched),
            Mode::EofCr => (2, 0, 0, 0),
            Mode::LitString { depth, escape } => (3, u64::from(depth), 0, u8::from(escape)),
            Mode::HexString => (4, 0, 0, 0),
            Mode::AfterStream { cr, length } => (
                5 + u8::from(length.is_some()),
                length.unwrap_or(0),
                0,
                u8::from(cr),
            ),
            Mode::Data { left, end } => (7, left, end, 0),
            Mode::Verify { end, eol, matched } => (8, end, u64::from(eol), matched),
            Mode::Search {
                data,
                matched,
                at,
                eol,
            } => (9, data, at, matched | (eol << 4)),
        };
        w.u8(tag);
        w.u64(a);
        w.u64(b);
        w.u8(c);
        w.bool(self.pending.is_some());
        w.u8(self.pending.unwrap_or(0));
        w.0.extend_from_slice(&self.token);
        w.u8(self.token_len);
        w.bool(self.token_long);
        w.u64(self.token_start);
        w.bool(self.in_token);
        w.u64(self.ints[0]);
        w.u64(self.ints[1]);
        w.u8(self.int_count);
        w.bool(self.in_object);
        w.u32(self.depth);
        let (ltag, lv) = match self.length {
            LengthState::None => (0, 0),
            LengthState::Key => (1, 0),
            LengthState::Num(n) => (2, n),
            LengthState::NumNum(n) => (3, n),
            LengthState::Direct(n) => (4, n),
            LengthState::Unknown => (5, 0),
        };
        w.u8(ltag);
        w.u64(lv);
        w.0.extend_from_slice(&self.last);
        w.u64(self.objects);
        w.u8(match self.unsupported {
            None => 0,
            Some(Unsupported::Unterminated) => 1,
            Some(Unsupported::LengthMismatch) => 2,
            Some(Unsupported::NoObjects) => 3,
        });
        w.bool(self.finished);
        debug_assert_eq!(w.0.len() - start, SCANNER_STATE_LEN);
    }

    /// Read a state saved by [`Self::save`]; anything out of range is an error, never a
    /// panic.
    pub(crate) fn restore(r: &mut StateReader<'_>) -> Result<Self, StateError> {
        let pos = r.u64()?;
        let (tag, a, b, c) = (r.u8()?, r.u64()?, r.u64()?, r.u8()?);
        let small = |v: u64| u8::try_from(v).map_err(|_| StateError("mode field"));
        let mode = match tag {
            0 => Mode::Normal,
            1 if c <= 7 => Mode::Comment { eof_matched: c },
            2 => Mode::EofCr,
            3 => Mode::LitString {
                depth: u32::try_from(a).map_err(|_| StateError("string depth"))?,
                escape: c == 1,
            },
            4 => Mode::HexString,
            5 | 6 => Mode::AfterStream {
                cr: c == 1,
                length: (tag == 6).then_some(a),
            },
            7 => Mode::Data { left: a, end: b },
            8 if small(b)? <= 2 && (c as usize) < ENDSTREAM.len() => Mode::Verify {
                end: a,
                eol: small(b)?,
                matched: c,
            },
            9 if ((c & 0x0f) as usize) < ENDSTREAM.len() && (c >> 4) <= 2 => Mode::Search {
                data: a,
                matched: c & 0x0f,
                at: b,
                eol: c >> 4,
            },
            _ => return Err(StateError("scanner mode")),
        };
        let has_pending = r.bool()?;
        let pending_byte = r.u8()?;
        let mut token = [0; TOKEN_CAP];
        token.copy_from_slice(r.bytes(TOKEN_CAP)?);
        let token_len = r.u8()?;
        if token_len as usize > TOKEN_CAP {
            return Err(StateError("token length"));
        }
        let token_long = r.bool()?;
        let token_start = r.u64()?;
        let in_token = r.bool()?;
        let ints = [r.u64()?, r.u64()?];
        let int_count = r.u8()?;
        if int_count > 2 {
            return Err(StateError("integer count"));
        }
        let in_object = r.bool()?;
        let depth = r.u32()?;
        let (ltag, lv) = (r.u8()?, r.u64()?);
        let length = match ltag {
            0 => LengthState::None,
            1 => LengthState::Key,
            2 => LengthState::Num(lv),
            3 => LengthState::NumNum(lv),
            4 => LengthState::Direct(lv),
            5 => LengthState::Unknown,
            _ => return Err(StateError("length state")),
        };
        let mut last = [0; 2];
        last.copy_from_slice(r.bytes(2)?);
        let objects = r.u64()?;
        let unsupported = match r.u8()? {
            0 => None,
            1 => Some(Unsupported::Unterminated),
            2 => Some(Unsupported::LengthMismatch),
            3 => Some(Unsupported::NoObjects),
            _ => return Err(StateError("unsupported kind")),
        };
        let finished = r.bool()?;
        Ok(Self {
            pos,
            mode,
            pending: has_pending.then_some(pending_byte),
            token,
            token_len,
            token_long,
            token_start,
            in_token,
            ints,
            int_count,
            in_object,
            depth,
            length,
            last,
            objects,
            unsupported,
            finished,
        })
    }
}
