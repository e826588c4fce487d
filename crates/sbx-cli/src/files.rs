//! `sbx cp` and `sbx fs ls|stat|mkdir|rm|mv|chmod|grep|sed`: a sandbox's files, through the
//! node's `/v1/sandboxes/{id}/files` API. Transfers stream both ways (a directory as a tar
//! stream made or unpacked as it goes), with a progress bar on a terminal.

use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sbx_api::ErrorCode;
use sbx_client::{Chmod, Client, FileEntry, Grep, Mkdir, Sed, TarUpload, Upload};

use crate::{print_json, Cli};

/// Transfers smaller than this show no progress bar.
const BAR_FROM: u64 = 8 << 20;

#[derive(clap::Args, Debug)]
pub struct CpArgs {
    /// What to copy: a local path, or SANDBOX:PATH.
    src: String,
    /// Where to: a local path, or SANDBOX:PATH. An existing directory receives the source
    /// under its own name (end the source with /. to copy a directory's contents instead).
    dst: String,
    /// Permission bits of an uploaded file (octal; default: the local file's).
    #[arg(long)]
    mode: Option<String>,
    /// Owner in the sandbox of what is uploaded (name, uid or uid:gid; default: the
    /// sandbox's user).
    #[arg(long)]
    owner: Option<String>,
    /// No progress bar.
    #[arg(short, long)]
    quiet: bool,
}

#[derive(clap::Subcommand, Debug)]
pub enum FsCmd {
    /// List a directory.
    Ls {
        /// The sandbox (id or name).
        sandbox: String,
        path: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Describe a path (a symlink is described, not followed). Prints JSON.
    Stat { sandbox: String, path: String },
    /// Make a directory.
    Mkdir {
        /// Make missing parents; an existing directory is no error.
        #[arg(short, long)]
        parents: bool,
        /// Permission bits (octal).
        #[arg(short, long)]
        mode: Option<String>,
        /// Owner (name, uid or uid:gid).
        #[arg(long)]
        owner: Option<String>,
        sandbox: String,
        path: String,
    },
    /// Remove a file, a symlink or an empty directory (-r: a directory and all in it).
    Rm {
        #[arg(short, long)]
        recursive: bool,
        sandbox: String,
        path: String,
    },
    /// Rename SRC to DST (exactly that path).
    Mv {
        /// Replace an existing DST.
        #[arg(short = 'f', long)]
        overwrite: bool,
        sandbox: String,
        src: String,
        dst: String,
    },
    /// Change permission bits (MODE, octal; - leaves them) and owners (--uid, --gid).
    Chmod {
        #[arg(short = 'R', long)]
        recursive: bool,
        #[arg(long)]
        uid: Option<u32>,
        #[arg(long)]
        gid: Option<u32>,
        sandbox: String,
        mode: String,
        path: String,
    },
    /// Search text files for a regular expression; prints PATH:LINE:TEXT, exits 1 on none.
    Grep {
        /// Ignore case.
        #[arg(short, long)]
        ignore_case: bool,
        /// The pattern is text, not a regular expression.
        #[arg(short = 'F', long)]
        literal: bool,
        /// Only the files of PATH itself, not of its subdirectories.
        #[arg(long)]
        no_recursive: bool,
        /// Only files matching this glob (repeatable).
        #[arg(long)]
        include: Vec<String>,
        /// Leave out files and directories matching this glob (repeatable).
        #[arg(long)]
        exclude: Vec<String>,
        /// Stop after this many matching lines.
        #[arg(short, long)]
        max: Option<u64>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        sandbox: String,
        pattern: String,
        path: String,
    },
    /// Replace a regular expression ($1, ${name} in the replacement) in text files.
    Sed {
        #[arg(short, long)]
        ignore_case: bool,
        /// Pattern and replacement are text.
        #[arg(short = 'F', long)]
        literal: bool,
        /// Only the first match of each file.
        #[arg(long)]
        first: bool,
        #[arg(long)]
        no_recursive: bool,
        #[arg(long)]
        include: Vec<String>,
        #[arg(long)]
        exclude: Vec<String>,
        #[arg(long)]
        json: bool,
        sandbox: String,
        pattern: String,
        replacement: String,
        path: String,
    },
}

/// A `SANDBOX:PATH` argument, or `None` for a local path.
fn remote(arg: &str) -> Option<(&str, &str)> {
    let (sb, path) = arg.split_once(':')?;
    (!sb.is_empty() && !sb.contains('/') && !sb.starts_with('.')).then_some((sb, path))
}

fn bar(len: Option<u64>, quiet: bool, what: &str) -> ProgressBar {
    if quiet || len.is_some_and(|l| l < BAR_FROM) {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::with_draw_target(len, ProgressDrawTarget::stderr());
    let style = match len {
        Some(_) => ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {eta}",
        ),
        None => ProgressStyle::with_template("{msg} {spinner} {bytes} {bytes_per_sec}"),
    };
    if let Ok(s) = style {
        pb.set_style(s.progress_chars("=> "));
    }
    pb.set_message(what.to_string());
    pb.enable_steady_tick(Duration::from_millis(200));
    pb
}

fn base_name(p: &str) -> String {
    Path::new(p.trim_end_matches('/'))
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn join_remote(dir: &str, name: &str) -> String {
    format!("{}/{name}", dir.trim_end_matches('/'))
}

pub fn cp(cli: &Cli, a: &CpArgs) -> anyhow::Result<u8> {
    let client = cli.client();
    match (remote(&a.src), remote(&a.dst)) {
        (None, Some((sb, path))) => upload(&client, a, sb, path),
        (Some((sb, path)), None) => download(&client, a, sb, path),
        (Some(_), Some(_)) => bail!("copy between sandboxes through a local path"),
        (None, None) => bail!("one of SRC and DST is SANDBOX:PATH"),
    }
}

fn upload(client: &Client, a: &CpArgs, sb: &str, dst: &str) -> anyhow::Result<u8> {
    let src = Path::new(&a.src);
    let md = std::fs::metadata(src).with_context(|| format!("{}", src.display()))?;
    let contents = a.src.ends_with("/.");
    let existing = client.stat_if_any(sb, dst)?;
    let into_dir = existing.as_ref().is_some_and(FileEntry::is_dir) || dst.ends_with('/');
    let target = if into_dir && !contents {
        join_remote(dst, &base_name(&a.src))
    } else {
        dst.to_string()
    };
    if md.is_dir() {
        return upload_dir(client, a, sb, src, &target);
    }
    let file = File::open(src).with_context(|| format!("open {}", src.display()))?;
    let len = md.len();
    let mode = a
        .mode
        .clone()
        .unwrap_or_else(|| format!("{:04o}", md.permissions().mode() & 0o7777));
    let pb = bar(Some(len), a.quiet, &base_name(&a.src));
    let opts = Upload {
        mode: Some(mode),
        parents: true,
        owner: a.owner.clone(),
    };
    let v = client.upload(sb, &target, &opts, pb.wrap_read(file), Some(len))?;
    pb.finish_and_clear();
    if v.bytes_written != len {
        bail!("{} bytes of {len} arrived in the sandbox", v.bytes_written);
    }
    Ok(0)
}

/// Writes a tar stream of `dir` into `w` (on a thread of its own).
fn tar_into(dir: &Path, w: impl Write) -> io::Result<()> {
    let mut b = tar::Builder::new(w);
    b.follow_symlinks(false);
    b.mode(tar::HeaderMode::Complete);
    b.append_dir_all(".", dir)?;
    b.into_inner()?.flush()
}

fn upload_dir(
    client: &Client,
    a: &CpArgs,
    sb: &str,
    src: &Path,
    target: &str,
) -> anyhow::Result<u8> {
    let (reader, writer) = io::pipe().context("a pipe")?;
    let dir = src.to_path_buf();
    let maker = std::thread::spawn(move || tar_into(&dir, writer));
    let pb = bar(None, a.quiet, &base_name(&a.src));
    let opts = TarUpload {
        owner: a.owner.clone(),
        ..TarUpload::default()
    };
    let sent = client.upload_tar(sb, target, &opts, pb.wrap_read(reader));
    pb.finish_and_clear();
    let made = maker
        .join()
        .map_err(|_| anyhow!("the tar stream's thread failed"))?;
    let v = sent?;
    made.with_context(|| format!("reading {}", src.display()))?;
    if !a.quiet {
        eprintln!(
            "sbx: {} entries, {} bytes into {sb}:{target}",
            v.entries, v.bytes
        );
    }
    Ok(0)
}

fn download(client: &Client, a: &CpArgs, sb: &str, src: &str) -> anyhow::Result<u8> {
    let st = client
        .stat_if_any(sb, src)?
        .ok_or_else(|| anyhow!("{sb}:{src}: no such file"))?;
    let local = PathBuf::from(&a.dst);
    let into_dir = local.is_dir() || a.dst.ends_with('/');
    let contents = src.ends_with("/.");
    let target = if into_dir && !contents {
        local.join(base_name(src))
    } else {
        local
    };
    if st.is_dir() {
        return download_dir(client, a, sb, src, &target);
    }
    let resp = match client.download(sb, src, None) {
        Ok(r) => r,
        // A symlink to a directory: the directory.
        Err(e) if st.kind == "symlink" && e.code() == Some(ErrorCode::WrongType) => {
            return download_dir(client, a, sb, src, &target);
        }
        Err(e) => return Err(e.into()),
    };
    let len = resp.len;
    let pb = bar(len, a.quiet, &base_name(src));
    let mut out = File::create(&target).with_context(|| format!("create {}", target.display()))?;
    let got = io::copy(&mut pb.wrap_read(resp), &mut out)
        .with_context(|| format!("the download of {sb}:{src} broke off"))?;
    pb.finish_and_clear();
    if len.is_some_and(|l| l != got) {
        bail!("the download of {sb}:{src} broke off after {got} bytes");
    }
    if let Some(m) = st.mode_bits() {
        let _ = std::fs::set_permissions(&target, std::fs::Permissions::from_mode(m & 0o777));
    }
    Ok(0)
}

fn download_dir(
    client: &Client,
    a: &CpArgs,
    sb: &str,
    src: &str,
    target: &Path,
) -> anyhow::Result<u8> {
    let resp = client.download_tar(sb, src)?;
    std::fs::create_dir_all(target).with_context(|| format!("mkdir {}", target.display()))?;
    let pb = bar(None, a.quiet, &base_name(src));
    let mut ar = tar::Archive::new(pb.wrap_read(resp));
    ar.set_preserve_permissions(true);
    ar.set_preserve_mtime(true);
    ar.unpack(target)
        .with_context(|| format!("unpacking {sb}:{src} into {}", target.display()))?;
    pb.finish_and_clear();
    Ok(0)
}

fn mode_string(e: &FileEntry) -> String {
    let t = match e.kind.as_str() {
        "dir" => 'd',
        "symlink" => 'l',
        "fifo" => 'p',
        "socket" => 's',
        "char_device" => 'c',
        "block_device" => 'b',
        _ => '-',
    };
    let m = e.mode_bits().unwrap_or(0);
    let mut s = String::from(t);
    for (i, c) in "rwxrwxrwx".chars().enumerate() {
        s.push(if m & (0o400 >> i) != 0 { c } else { '-' });
    }
    s
}

pub fn fs(cli: &Cli, cmd: &FsCmd) -> anyhow::Result<u8> {
    let client = cli.client();
    match cmd {
        FsCmd::Ls {
            sandbox,
            path,
            json,
        } => {
            let v = client.list_files(sandbox, path, None)?;
            if *json {
                print_json(&v)?;
                return Ok(0);
            }
            let mut out = io::stdout().lock();
            for e in &v.entries {
                let target = e
                    .target
                    .as_deref()
                    .map(|t| format!(" -> {t}"))
                    .unwrap_or_default();
                writeln!(
                    out,
                    "{} {:>6} {:>6} {:>12} {} {}{target}",
                    mode_string(e),
                    e.uid,
                    e.gid,
                    e.size,
                    e.modified_at,
                    e.name
                )?;
            }
            if v.truncated {
                eprintln!("sbx: the listing is cut (too many entries)");
            }
            Ok(0)
        }
        FsCmd::Stat { sandbox, path } => {
            print_json(&client.stat(sandbox, path)?)?;
            Ok(0)
        }
        FsCmd::Mkdir {
            parents,
            mode,
            owner,
            sandbox,
            path,
        } => {
            let m = Mkdir {
                parents: *parents,
                mode: mode.clone(),
                owner: owner.clone(),
            };
            client.mkdir(sandbox, path, &m)?;
            Ok(0)
        }
        FsCmd::Rm {
            recursive,
            sandbox,
            path,
        } => {
            client.remove(sandbox, path, *recursive)?;
            Ok(0)
        }
        FsCmd::Mv {
            overwrite,
            sandbox,
            src,
            dst,
        } => {
            client.rename(sandbox, src, dst, *overwrite)?;
            Ok(0)
        }
        FsCmd::Chmod {
            recursive,
            uid,
            gid,
            sandbox,
            mode,
            path,
        } => {
            let c = Chmod {
                mode: (mode != "-").then(|| mode.clone()),
                uid: *uid,
                gid: *gid,
                recursive: *recursive,
            };
            client.chmod(sandbox, path, &c)?;
            Ok(0)
        }
        FsCmd::Grep {
            ignore_case,
            literal,
            no_recursive,
            include,
            exclude,
            max,
            json,
            sandbox,
            pattern,
            path,
        } => {
            let g = Grep {
                ignore_case: *ignore_case,
                literal: *literal,
                recursive: !no_recursive,
                include: include.clone(),
                exclude: exclude.clone(),
                max_matches: *max,
                ..Grep::new(pattern.clone())
            };
            let v = client.grep(sandbox, path, &g)?;
            if *json {
                print_json(&v)?;
            } else {
                let mut out = io::stdout().lock();
                for m in &v.matches {
                    writeln!(out, "{}:{}:{}", m.path, m.line, m.text)?;
                }
                if v.truncated {
                    eprintln!("sbx: stopped at {} matches", v.matches.len());
                }
            }
            Ok(if v.matches.is_empty() { 1 } else { 0 })
        }
        FsCmd::Sed {
            ignore_case,
            literal,
            first,
            no_recursive,
            include,
            exclude,
            json,
            sandbox,
            pattern,
            replacement,
            path,
        } => {
            let sed = Sed {
                ignore_case: *ignore_case,
                literal: *literal,
                first_only: *first,
                recursive: !no_recursive,
                include: include.clone(),
                exclude: exclude.clone(),
                ..Sed::new(pattern.clone(), replacement.clone())
            };
            let v = client.sed(sandbox, path, &sed)?;
            if *json {
                print_json(&v)?;
            } else {
                let mut out = io::stdout().lock();
                for f in &v.files {
                    writeln!(out, "{}: {}", f.path, f.replacements)?;
                }
            }
            Ok(0)
        }
    }
}

/// Reads all of a reader (tests).
#[cfg(test)]
fn read_all(mut r: impl io::Read) -> Vec<u8> {
    let mut v = Vec::new();
    r.read_to_end(&mut v).unwrap();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_arguments() {
        assert_eq!(remote("sb:/work/a"), Some(("sb", "/work/a")));
        assert_eq!(
            remote("sbx-0123456789abcdef:/a:b"),
            Some(("sbx-0123456789abcdef", "/a:b"))
        );
        assert_eq!(remote("./a:b"), None);
        assert_eq!(remote("/tmp/a:b"), None);
        assert_eq!(remote("plain"), None);
        assert_eq!(remote(":x"), None);
    }

    #[test]
    fn ls_modes() {
        let entry = |kind: &str, mode: &str| -> FileEntry {
            serde_json::from_value(serde_json::json!({"object": "file", "name": "a",
                "path": "/a", "type": kind, "size": 0, "mode": mode, "uid": 0, "gid": 0,
                "modified_at": "2026-01-01T00:00:00.000Z", "target": null}))
            .unwrap()
        };
        assert_eq!(mode_string(&entry("dir", "0755")), "drwxr-xr-x");
        assert_eq!(mode_string(&entry("file", "0640")), "-rw-r-----");
    }

    #[test]
    fn a_directory_becomes_a_tar_stream() {
        let dir = std::env::temp_dir().join(format!("sbx-cli-tar-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("sub/a.txt"), b"hi").unwrap();
        let (r, w) = io::pipe().unwrap();
        let d = dir.clone();
        let t = std::thread::spawn(move || tar_into(&d, w));
        let bytes = read_all(r);
        t.join().unwrap().unwrap();
        let mut ar = tar::Archive::new(&bytes[..]);
        let names: Vec<String> = ar
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().any(|n| n.ends_with("sub/a.txt")), "{names:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
