//! A sandbox's objects: `sandboxes/<id>/e<epoch>/<part>.tar.zst` (a tree) or `<part>.zst` (a
//! file or a stream), and `sandboxes/<id>/e<epoch>/manifest.json` written last, so that a
//! manifest's presence means every part it lists is whole.

use std::io::{Read, Write};
use std::path::Path;

use object_store::path::Path as ObjectPath;
use object_store::{ObjectStoreExt, PutPayload};
use serde::{Deserialize, Serialize};

use crate::error::{BlobError, Result};
use crate::pipe::{Expect, Target};
use crate::store::{self, Stats, Store};

/// The folder of every sandbox's objects.
pub const SANDBOXES: &str = "sandboxes";
/// The manifest's file name in an epoch's folder.
pub const MANIFEST: &str = "manifest.json";

/// What an epoch's objects were written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Sleep,
    Snapshot,
}

/// How a part is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// A directory as a tar stream, zstd (`<name>.tar.zst`).
    #[default]
    Tar,
    /// One file or stream as it is, zstd (`<name>.zst`).
    Raw,
}

/// One object of an epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Part {
    pub name: String,
    #[serde(default)]
    pub format: Format,
    /// The plain stream's bytes (the tar stream, the file).
    pub bytes: u64,
    /// The object's bytes.
    pub stored_bytes: u64,
    /// The object's sha256, lowercase hex.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
}

/// What an epoch holds; written after its parts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub sandbox_id: String,
    pub epoch: u64,
    /// The build of the node that wrote it (kernel, CRIU and agent versions): another build
    /// cannot restore its memory.
    pub build: String,
    /// The id of the image the sandbox's disk is over.
    pub image: String,
    pub kind: Kind,
    pub parts: Vec<Part>,
    /// RFC 3339, UTC.
    pub written_at: String,
}

impl Manifest {
    pub fn part(&self, name: &str) -> Option<&Part> {
        self.parts.iter().find(|p| p.name == name)
    }

    /// The parts' plain bytes.
    pub fn bytes(&self) -> u64 {
        self.parts.iter().map(|p| p.bytes).sum()
    }

    /// The parts' stored bytes.
    pub fn stored_bytes(&self) -> u64 {
        self.parts.iter().map(|p| p.stored_bytes).sum()
    }
}

/// A sandbox id or a part name as a key's segment: 1 to 128 of `A-Z a-z 0-9 _ -` (and `.` in
/// an id, not first).
fn check_name(what: &'static str, value: &str, dots: bool) -> Result<()> {
    let bad = |why| BlobError::BadName {
        what,
        value: value.to_string(),
        why,
    };
    if value.is_empty() || value.len() > 128 {
        return Err(bad("1 to 128 characters"));
    }
    if value.starts_with('.') {
        return Err(bad("a name does not start with `.`"));
    }
    let ok = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-' || (dots && c == '.');
    if !value.chars().all(ok) {
        return Err(bad(if dots {
            "letters, digits, `_`, `-` and `.` only"
        } else {
            "letters, digits, `_` and `-` only"
        }));
    }
    Ok(())
}

fn sandbox_prefix(id: &str) -> Result<String> {
    check_name("sandbox id", id, true)?;
    Ok(format!("{SANDBOXES}/{id}"))
}

/// `sandboxes/<id>/e<epoch>`.
pub fn epoch_prefix(sandbox_id: &str, epoch: u64) -> Result<String> {
    Ok(format!("{}/e{epoch}", sandbox_prefix(sandbox_id)?))
}

/// `sandboxes/<id>/e<epoch>/<name>.tar.zst` or `<name>.zst`.
pub fn part_key(sandbox_id: &str, epoch: u64, name: &str, format: Format) -> Result<String> {
    check_name("part name", name, false)?;
    let ext = match format {
        Format::Tar => "tar.zst",
        Format::Raw => "zst",
    };
    Ok(format!("{}/{name}.{ext}", epoch_prefix(sandbox_id, epoch)?))
}

/// `sandboxes/<id>/e<epoch>/manifest.json`.
pub fn manifest_key(sandbox_id: &str, epoch: u64) -> Result<String> {
    Ok(format!("{}/{MANIFEST}", epoch_prefix(sandbox_id, epoch)?))
}

/// An epoch being written: its parts, then [`EpochWriter::finish`] writes the manifest. One
/// dropped or failed before `finish` leaves no manifest (its parts are garbage that
/// [`Store::delete_epoch`] takes away).
#[derive(Debug)]
pub struct EpochWriter {
    store: Store,
    sandbox_id: String,
    epoch: u64,
    parts: Vec<Part>,
}

impl EpochWriter {
    fn target(&mut self, name: &str, format: Format) -> Result<Target> {
        if self.parts.iter().any(|p| p.name == name) {
            return Err(BlobError::BadName {
                what: "part name",
                value: name.to_string(),
                why: "already written in this epoch",
            });
        }
        self.store
            .target(&part_key(&self.sandbox_id, self.epoch, name, format)?)
    }

    fn add(&mut self, name: &str, format: Format, stats: &Stats) {
        self.parts.push(Part {
            name: name.to_string(),
            format,
            bytes: stats.bytes,
            stored_bytes: stats.stored_bytes,
            sha256: Some(stats.sha256.clone()),
        });
    }

    /// A directory as the part `name` (`<name>.tar.zst`).
    pub async fn put_tree(&mut self, name: &str, dir: &Path) -> Result<Stats> {
        let target = self.target(name, Format::Tar)?;
        let stats = store::put_tree_at(&target, dir).await?;
        self.add(name, Format::Tar, &stats);
        Ok(stats)
    }

    /// A file as the part `name` (`<name>.zst`).
    pub async fn put_file(&mut self, name: &str, path: &Path) -> Result<Stats> {
        let target = self.target(name, Format::Raw)?;
        let stats = store::put_file_at(&target, path).await?;
        self.add(name, Format::Raw, &stats);
        Ok(stats)
    }

    /// A stream as the part `name` (`<name>.zst`).
    pub async fn put_reader<R: Read + Send + 'static>(
        &mut self,
        name: &str,
        reader: R,
    ) -> Result<Stats> {
        let target = self.target(name, Format::Raw)?;
        let stats = store::put_reader_at(&target, reader).await?;
        self.add(name, Format::Raw, &stats);
        Ok(stats)
    }

    /// The parts written so far.
    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// Writes the manifest (last): the epoch is whole from then on.
    pub async fn finish(self, build: &str, image: &str, kind: Kind) -> Result<Manifest> {
        let m = Manifest {
            sandbox_id: self.sandbox_id,
            epoch: self.epoch,
            build: build.to_string(),
            image: image.to_string(),
            kind,
            parts: self.parts,
            written_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        };
        self.store.put_manifest(&m).await?;
        Ok(m)
    }
}

impl Store {
    /// Begins writing an epoch of a sandbox. Refused when that epoch already has a manifest
    /// (an epoch is written once, by the node that holds the sandbox at it).
    pub async fn epoch_writer(&self, sandbox_id: &str, epoch: u64) -> Result<EpochWriter> {
        let key = manifest_key(sandbox_id, epoch)?;
        if self.exists(&key).await? {
            return Err(BlobError::EpochWritten {
                sandbox_id: sandbox_id.to_string(),
                epoch,
            });
        }
        Ok(EpochWriter {
            store: self.clone(),
            sandbox_id: sandbox_id.to_string(),
            epoch,
            parts: Vec::new(),
        })
    }

    /// Writes a manifest at `sandboxes/<id>/e<epoch>/manifest.json` (whole or not at all).
    pub async fn put_manifest(&self, m: &Manifest) -> Result<()> {
        for p in &m.parts {
            check_name("part name", &p.name, false)?;
        }
        let target = self.target(&manifest_key(&m.sandbox_id, m.epoch)?)?;
        let body = serde_json::to_vec_pretty(m).map_err(|e| BlobError::BadManifest {
            key: target.key(),
            source: e,
        })?;
        self.inner
            .put(&target.path, PutPayload::from(body))
            .await
            .map_err(|e| target.store_err(e))?;
        Ok(())
    }

    /// The manifest of an epoch; NotFound when the epoch was never written whole.
    pub async fn manifest(&self, sandbox_id: &str, epoch: u64) -> Result<Manifest> {
        let target = self.target(&manifest_key(sandbox_id, epoch)?)?;
        let got = self
            .inner
            .get(&target.path)
            .await
            .map_err(|e| target.store_err(e))?;
        let body = got.bytes().await.map_err(|e| target.store_err(e))?;
        serde_json::from_slice(&body).map_err(|e| BlobError::BadManifest {
            key: target.key(),
            source: e,
        })
    }

    /// The epochs that have objects of the sandbox (whole or not), lowest first. From the
    /// objects themselves, not the folders a listing shows (an S3 server may show a folder
    /// emptied a moment ago).
    pub async fn epochs(&self, sandbox_id: &str) -> Result<Vec<u64>> {
        use futures_util::TryStreamExt;
        let prefix = sandbox_prefix(sandbox_id)?;
        let target = self.target(&prefix)?;
        let depth = target.path.parts().count();
        let objects: Vec<ObjectPath> = self
            .inner
            .list(Some(&target.path))
            .map_ok(|m| m.location)
            .try_collect()
            .await
            .map_err(|e| target.store_err(e))?;
        let mut out: Vec<u64> = objects
            .iter()
            .filter_map(|p| {
                let parts: Vec<_> = p.parts().skip(depth).collect();
                // An object in an epoch's folder: e<n>/<name>.
                if parts.len() < 2 {
                    return None;
                }
                parse_epoch(parts[0].as_ref())
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        Ok(out)
    }

    /// The manifest of the highest epoch that has one.
    pub async fn latest(&self, sandbox_id: &str) -> Result<Option<Manifest>> {
        for epoch in self.epochs(sandbox_id).await?.into_iter().rev() {
            match self.manifest(sandbox_id, epoch).await {
                Ok(m) => return Ok(Some(m)),
                Err(e) if e.is_not_found() => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// Deletes an epoch's objects, its manifest first (so that a delete cut short leaves an
    /// epoch that is not whole, never one whose manifest lists what is gone).
    pub async fn delete_epoch(&self, sandbox_id: &str, epoch: u64) -> Result<()> {
        let manifest = self.target(&manifest_key(sandbox_id, epoch)?)?;
        store::delete_at(&manifest).await?;
        let prefix = self.target(&epoch_prefix(sandbox_id, epoch)?)?;
        self.delete_under(&prefix).await
    }

    /// Deletes every epoch of a sandbox.
    pub async fn delete_sandbox(&self, sandbox_id: &str) -> Result<()> {
        for epoch in self.epochs(sandbox_id).await? {
            self.delete_epoch(sandbox_id, epoch).await?;
        }
        Ok(())
    }

    async fn delete_under(&self, prefix: &Target) -> Result<()> {
        use futures_util::TryStreamExt;
        let objects: Vec<ObjectPath> = self
            .inner
            .list(Some(&prefix.path))
            .map_ok(|m| m.location)
            .try_collect()
            .await
            .map_err(|e| prefix.store_err(e))?;
        for path in objects {
            let target = Target {
                store: prefix.store.clone(),
                path,
                desc: prefix.desc.clone(),
            };
            store::delete_at(&target).await?;
        }
        Ok(())
    }

    fn part_target(&self, m: &Manifest, name: &str) -> Result<(Target, Expect)> {
        let part = m.part(name).ok_or_else(|| BlobError::NoSuchPart {
            sandbox_id: m.sandbox_id.clone(),
            epoch: m.epoch,
            part: name.to_string(),
        })?;
        let target = self.target(&part_key(&m.sandbox_id, m.epoch, name, part.format)?)?;
        let expect = Expect {
            bytes: part.bytes,
            stored_bytes: part.stored_bytes,
            sha256: part.sha256.clone(),
        };
        Ok((target, expect))
    }

    /// Downloads a tree part of a manifest into `dest` (new or empty), checked against the
    /// manifest's sizes and sha256 (a mismatch: `Corrupt`, `dest` cleared).
    pub async fn get_part_tree(&self, m: &Manifest, name: &str, dest: &Path) -> Result<Stats> {
        let (target, expect) = self.part_target(m, name)?;
        store::get_tree_at(&target, dest, Some(expect)).await
    }

    /// Downloads a file part of a manifest into `dest` (which must not exist), checked.
    pub async fn get_part_file(&self, m: &Manifest, name: &str, dest: &Path) -> Result<Stats> {
        let (target, expect) = self.part_target(m, name)?;
        store::get_file_at(&target, dest, Some(expect)).await
    }

    /// Downloads a stream part of a manifest into `writer`, checked (only once the whole
    /// stream went into `writer`: a `Corrupt` answer means what it got is to be thrown away).
    pub async fn get_part_writer<W: Write + Send + 'static>(
        &self,
        m: &Manifest,
        name: &str,
        writer: W,
    ) -> Result<(W, Stats)> {
        let (target, expect) = self.part_target(m, name)?;
        store::get_writer_at(&target, writer, Some(expect)).await
    }
}

/// `e<digits>` (no leading zero but in `e0`) to the epoch.
fn parse_epoch(segment: &str) -> Option<u64> {
    let digits = segment.strip_prefix('e')?;
    let n: u64 = digits.parse().ok()?;
    (n.to_string() == digits).then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_follow_the_layout() {
        assert_eq!(
            part_key("sbx-abc", 3, "memory", Format::Tar).unwrap(),
            "sandboxes/sbx-abc/e3/memory.tar.zst"
        );
        assert_eq!(
            part_key("sbx-abc", 3, "disk", Format::Raw).unwrap(),
            "sandboxes/sbx-abc/e3/disk.zst"
        );
        assert_eq!(
            manifest_key("sbx-abc", 12).unwrap(),
            "sandboxes/sbx-abc/e12/manifest.json"
        );
    }

    #[test]
    fn names_that_could_leave_their_folder_are_refused() {
        for id in ["", "..", ".x", "a/b", "a b", "é", &"x".repeat(129)] {
            assert!(
                matches!(epoch_prefix(id, 1), Err(BlobError::BadName { .. })),
                "{id:?}"
            );
        }
        // A dot in a part's name could make `x.tar` (raw) the key of `x` (tar).
        assert!(part_key("sbx-a", 1, "x.tar", Format::Raw).is_err());
        assert!(part_key("sbx-a", 1, "manifest_json", Format::Raw).is_ok());
    }

    #[test]
    fn epochs_parse_only_in_their_form() {
        assert_eq!(parse_epoch("e0"), Some(0));
        assert_eq!(parse_epoch("e42"), Some(42));
        for s in ["e", "e01", "x1", "e1x", "e-1", "E1", "e+1"] {
            assert_eq!(parse_epoch(s), None, "{s}");
        }
    }

    #[test]
    fn a_manifest_reads_back_and_tells_unknown_kinds() {
        let m = Manifest {
            sandbox_id: "sbx-a".into(),
            epoch: 2,
            build: "b1".into(),
            image: "img-1".into(),
            kind: Kind::Snapshot,
            parts: vec![Part {
                name: "memory".into(),
                format: Format::Tar,
                bytes: 10,
                stored_bytes: 5,
                sha256: None,
            }],
            written_at: "2026-01-01T00:00:00.000Z".into(),
        };
        let text = serde_json::to_string(&m).unwrap();
        assert!(text.contains("\"kind\":\"snapshot\""), "{text}");
        assert!(!text.contains("sha256"), "{text}");
        assert_eq!(serde_json::from_str::<Manifest>(&text).unwrap(), m);
        let other = text.replace("\"snapshot\"", "\"nap\"");
        assert!(serde_json::from_str::<Manifest>(&other).is_err());
    }
}
