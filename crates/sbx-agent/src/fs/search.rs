//! grep and sed over a file or a tree: the pattern, lines read with a cap, binary files
//! skipped, replacements written through a temporary file.

use std::fs::{self, File};
use std::io::{self, BufRead, BufReader, BufWriter, Seek, SeekFrom, Write};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use regex::bytes::{Regex, RegexBuilder};
use sbx_proto::{FsErrorCode, FsFailure, FsResult, GrepMatch, GrepSpec, SedFile, SedSpec};

use super::path::{fail, normalize};
use super::transfer::Temp;
use super::walk::{each_file, Globs};
use super::{Ctx, Res, REPLY_BUDGET};

/// The part of a line grep looks at; the rest of a longer line is skipped.
const GREP_LINE_CAP: usize = 1 << 20;
/// sed leaves a file with a longer line as it is.
const SED_LINE_CAP: usize = 16 << 20;
/// A file with a NUL byte in its first this many bytes is binary: grep and sed skip it.
const BINARY_PROBE: usize = 8 << 10;

fn build_regex(pattern: &str, literal: bool, ignore_case: bool) -> Res<Regex> {
    if pattern.is_empty() {
        return Err(
            FsFailure::new(FsErrorCode::BadPattern, "the pattern is empty").param("pattern"),
        );
    }
    let src = if literal {
        regex::escape(pattern)
    } else {
        pattern.to_string()
    };
    RegexBuilder::new(&src)
        .case_insensitive(ignore_case)
        .size_limit(16 << 20)
        .build()
        .map_err(|e| {
            // The parser's message spans lines (the pattern, a caret, the error): one line.
            let why = e
                .to_string()
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ");
            FsFailure::new(FsErrorCode::BadPattern, format!("the pattern: {why}")).param("pattern")
        })
}

/// Reads one line (with its `\n`) into `line`, keeping at most `cap` bytes of it: the rest of
/// a longer line is read and dropped. Returns the bytes read (0 at the end) and whether the
/// line was cut.
fn read_line_capped<R: BufRead>(
    r: &mut R,
    line: &mut Vec<u8>,
    cap: usize,
) -> io::Result<(usize, bool)> {
    line.clear();
    let (mut total, mut cut) = (0, false);
    loop {
        let (done, used) = {
            let buf = match r.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if buf.is_empty() {
                return Ok((total, cut));
            }
            let (done, used) = match buf.iter().position(|b| *b == b'\n') {
                Some(i) => (true, i + 1),
                None => (false, buf.len()),
            };
            let take = cap.saturating_sub(line.len()).min(used);
            line.extend_from_slice(&buf[..take]);
            cut |= take < used;
            (done, used)
        };
        r.consume(used);
        total += used;
        if done {
            return Ok((total, cut));
        }
    }
}

/// A line without its end of line (`\n` or `\r\n`), and the end of line.
fn split_eol(line: &[u8]) -> (&[u8], &[u8]) {
    if line.ends_with(b"\r\n") {
        line.split_at(line.len() - 2)
    } else if line.ends_with(b"\n") {
        line.split_at(line.len() - 1)
    } else {
        (line, b"")
    }
}

fn is_binary<R: BufRead>(r: &mut R) -> io::Result<bool> {
    let buf = r.fill_buf()?;
    Ok(buf[..buf.len().min(BINARY_PROBE)].contains(&0))
}

fn cut_text(s: &str, max: usize) -> (String, bool) {
    if s.len() <= max {
        return (s.to_string(), false);
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    (s[..end].to_string(), true)
}

struct GrepState {
    matches: Vec<GrepMatch>,
    truncated: bool,
    scanned: u64,
    budget: usize,
}

pub(super) fn grep(c: &Ctx, g: &GrepSpec) -> Res<FsResult> {
    let re = build_regex(&g.pattern, g.literal, g.ignore_case)?;
    let globs = Globs::new(&g.include, &g.exclude)?;
    let root = normalize(&g.path, "path")?;
    let max = g.max_matches.unwrap_or(1000).max(1);
    let max_line = g.max_line_bytes.unwrap_or(4096).max(1) as usize;
    let mut st = GrepState {
        matches: Vec::new(),
        truncated: false,
        scanned: 0,
        budget: 0,
    };
    let single = fs::metadata(&root).map(|m| m.is_file()).unwrap_or(false);
    each_file(c, &root, g.recursive, &globs, &mut |path| {
        c.check()?;
        match grep_file(c, &re, path, max, max_line, &mut st) {
            Ok(()) => {}
            // A file that cannot be read is passed over in a tree, an error when asked for.
            Err(e) if single => return Err(fail(&e, path, "path")),
            Err(_) => {}
        }
        Ok(!st.truncated)
    })?;
    Ok(FsResult::Grep {
        matches: st.matches,
        truncated: st.truncated,
        files_scanned: st.scanned,
    })
}

fn grep_file(
    c: &Ctx,
    re: &Regex,
    path: &Path,
    max: u64,
    max_line: usize,
    st: &mut GrepState,
) -> io::Result<()> {
    let mut r = BufReader::with_capacity(64 << 10, File::open(path)?);
    st.scanned += 1;
    if is_binary(&mut r)? {
        return Ok(());
    }
    let shown = path.to_string_lossy();
    let mut line = Vec::new();
    let mut n = 0u64;
    loop {
        let (read, cut) = read_line_capped(&mut r, &mut line, GREP_LINE_CAP)?;
        if read == 0 {
            return Ok(());
        }
        n += 1;
        if n.is_multiple_of(8192) && c.cancelled() {
            return Ok(());
        }
        let (body, _) = split_eol(&line);
        let Some(m) = re.find(body) else {
            continue;
        };
        let (text, short) = cut_text(&String::from_utf8_lossy(body), max_line);
        st.budget += text.len() + shown.len() + 64;
        st.matches.push(GrepMatch {
            path: shown.to_string(),
            line: n,
            column: m.start() as u64 + 1,
            text,
            line_truncated: short || cut,
        });
        if st.matches.len() as u64 >= max || st.budget > REPLY_BUDGET {
            st.truncated = true;
            return Ok(());
        }
    }
}

pub(super) fn sed(c: &Ctx, s: &SedSpec) -> Res<FsResult> {
    let re = build_regex(&s.pattern, s.literal, s.ignore_case)?;
    let globs = Globs::new(&s.include, &s.exclude)?;
    let root = normalize(&s.path, "path")?;
    let single = fs::metadata(&root).map(|m| m.is_file()).unwrap_or(false);
    let (mut files, mut total, mut scanned, mut truncated, mut budget) =
        (Vec::new(), 0, 0, false, 0);
    each_file(c, &root, s.recursive, &globs, &mut |path| {
        c.check()?;
        scanned += 1;
        let n = match sed_file(&re, s.replacement.as_bytes(), s.literal, s.first_only, path) {
            Ok(n) => n,
            Err(e) if single => return Err(fail(&e, path, "path")),
            Err(_) => 0,
        };
        if n > 0 {
            total += n;
            let shown = path.to_string_lossy().into_owned();
            budget += shown.len() + 64;
            if budget > REPLY_BUDGET {
                truncated = true;
            } else {
                files.push(SedFile {
                    path: shown,
                    replacements: n,
                });
            }
        }
        Ok(true)
    })?;
    Ok(FsResult::Sed {
        files,
        replacements: total,
        files_scanned: scanned,
        truncated,
    })
}

/// Replaces in one file (through a temporary file that takes its place, its owner and mode
/// kept); the number of replacements. Binary files, and files with a line over
/// [`SED_LINE_CAP`], are left as they are.
fn sed_file(
    re: &Regex,
    rep: &[u8],
    literal: bool,
    first_only: bool,
    path: &Path,
) -> io::Result<u64> {
    let file = File::open(path)?;
    let md = file.metadata()?;
    if !md.is_file() {
        return Ok(0);
    }
    let mut r = BufReader::with_capacity(64 << 10, file);
    if is_binary(&mut r)? {
        return Ok(0);
    }
    // First: is there anything to replace (most files have nothing)?
    let mut line = Vec::new();
    let mut found = false;
    loop {
        let (read, cut) = read_line_capped(&mut r, &mut line, SED_LINE_CAP)?;
        if read == 0 {
            break;
        }
        if cut {
            return Ok(0);
        }
        if re.is_match(split_eol(&line).0) {
            found = true;
            break;
        }
    }
    if !found {
        return Ok(0);
    }
    r.seek(SeekFrom::Start(0))?;
    let target = fs::canonicalize(path)?;
    let (temp, out) = Temp::create(&target)?;
    let mut w = BufWriter::with_capacity(256 << 10, &out);
    let mut count = 0u64;
    let mut done = false;
    let mut expanded = Vec::new();
    loop {
        let (read, cut) = read_line_capped(&mut r, &mut line, SED_LINE_CAP)?;
        if read == 0 {
            break;
        }
        if cut {
            return Ok(0);
        }
        if done {
            w.write_all(&line)?;
            continue;
        }
        let (body, eol) = split_eol(&line);
        let mut last = 0;
        for caps in re.captures_iter(body) {
            let Some(m) = caps.get(0) else {
                continue;
            };
            w.write_all(&body[last..m.start()])?;
            if literal {
                w.write_all(rep)?;
            } else {
                expanded.clear();
                caps.expand(rep, &mut expanded);
                w.write_all(&expanded)?;
            }
            last = m.end();
            count += 1;
            if first_only {
                done = true;
                break;
            }
        }
        w.write_all(&body[last..])?;
        w.write_all(eol)?;
    }
    w.flush()?;
    drop(w);
    temp.commit(out, &target, Some((md.uid(), md.gid())), md.mode() & 0o7777)?;
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_lines_are_capped() {
        let data = b"short\nxxxxxxxxxxxxxxxx\nend";
        let mut r = BufReader::with_capacity(4, &data[..]);
        let mut line = Vec::new();
        assert_eq!(read_line_capped(&mut r, &mut line, 8).unwrap(), (6, false));
        assert_eq!(line, b"short\n");
        assert_eq!(read_line_capped(&mut r, &mut line, 8).unwrap(), (17, true));
        assert_eq!(line, b"xxxxxxxx");
        assert_eq!(read_line_capped(&mut r, &mut line, 8).unwrap(), (3, false));
        assert_eq!(line, b"end");
        assert_eq!(read_line_capped(&mut r, &mut line, 8).unwrap(), (0, false));
    }

    #[test]
    fn cut_text_keeps_whole_characters() {
        assert_eq!(cut_text("héllo", 2), ("h".to_string(), true));
        assert_eq!(cut_text("abc", 3), ("abc".to_string(), false));
    }
}
