//! A restored agent comes back not dumpable. CRIU saves each process's dumpable flag (the
//! `dumpable` field, 15, of its `mm_entry`) and its restorer sets it again before the restored
//! processes run. The agent is dumped while it is dumpable (a checkpoint needs it so), so left
//! alone it would come back dumpable and run so, beside the sandbox's processes, until the
//! node tells it otherwise: a process of the sandbox could ptrace it meanwhile. The flag is
//! set to 0 in the agent's image (the tree's root, the first entry of `pstree.img`), in
//! place: a varint of 1 and one of 0 take one byte each.

use std::path::Path;

use super::CriuError;

/// Every image file but the inventory starts with this magic, then the image's own.
const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
/// Service images (not of a process) start with this one instead.
const IMG_SERVICE_MAGIC: u32 = 0x5510_5940;

/// `pstree_entry.pid` and `mm_entry.dumpable`.
const PSTREE_PID: u64 = 1;
const MM_DUMPABLE: u64 = 15;

/// Makes the agent's saved dumpable flag 0 in the images at `images` (nothing to do when
/// it is 0 already or was not saved).
pub(crate) fn make_agent_not_dumpable(images: &Path) -> Result<(), CriuError> {
    let bad = |what: String| CriuError::Other(format!("the checkpoint's images: {what}"));
    let read =
        |name: &str| std::fs::read(images.join(name)).map_err(|e| bad(format!("read {name}: {e}")));
    let pstree = read("pstree.img")?;
    let root = first_entry(&pstree).ok_or_else(|| bad("pstree.img has no entry".into()))?;
    let pid = field_varint(root.1, PSTREE_PID)
        .map(|(v, _)| v)
        .ok_or_else(|| bad("pstree.img's first entry has no pid".into()))?;
    let name = format!("mm-{pid}.img");
    let mut mm = read(&name)?;
    let (start, entry) = first_entry(&mm).ok_or_else(|| bad(format!("{name} has no entry")))?;
    let Some((value, at)) = field_varint(entry, MM_DUMPABLE) else {
        return Ok(());
    };
    if value == 0 {
        return Ok(());
    }
    // A one-byte varint (0 to 127) is replaced by 0 in place; a longer one cannot be.
    if entry.get(at).is_some_and(|b| b & 0x80 != 0) {
        return Err(bad(format!("{name}: dumpable is {value}")));
    }
    mm[start + at] = 0;
    std::fs::write(images.join(&name), &mm).map_err(|e| bad(format!("write {name}: {e}")))
}

/// The first entry of an image file: (its offset in `img`, its bytes).
fn first_entry(img: &[u8]) -> Option<(usize, &[u8])> {
    let word = |at: usize| -> Option<u32> {
        Some(u32::from_le_bytes(img.get(at..at + 4)?.try_into().ok()?))
    };
    let mut at = 4;
    if matches!(word(0)?, IMG_COMMON_MAGIC | IMG_SERVICE_MAGIC) {
        at = 8;
    }
    let len = usize::try_from(word(at)?).ok()?;
    let start = at + 4;
    Some((start, img.get(start..start + len)?))
}

/// A varint: its value and its length.
fn varint(b: &[u8]) -> Option<(u64, usize)> {
    let mut v = 0u64;
    for (i, byte) in b.iter().enumerate().take(10) {
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((v, i + 1));
        }
    }
    None
}

/// The value of the top-level varint field `field` of the protobuf message `msg`, and where
/// the value starts in `msg`.
fn field_varint(msg: &[u8], field: u64) -> Option<(u64, usize)> {
    let mut at = 0;
    while at < msg.len() {
        let (key, n) = varint(&msg[at..])?;
        at += n;
        match key & 7 {
            0 => {
                let (v, n) = varint(&msg[at..])?;
                if key >> 3 == field {
                    return Some((v, at));
                }
                at += n;
            }
            1 => at += 8,
            2 => {
                let (len, n) = varint(&msg[at..])?;
                at += n + usize::try_from(len).ok()?;
            }
            5 => at += 4,
            _ => return None,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(magic: u32, entry: &[u8]) -> Vec<u8> {
        // The first bytes of CRIU's image files, as criu 4.2 writes them.
        let mut v = vec![0x19, 0x43, 0x56, 0x54];
        v.extend(magic.to_le_bytes());
        v.extend((entry.len() as u32).to_le_bytes());
        v.extend(entry);
        v
    }

    #[test]
    fn the_agent_s_flag_is_cleared_and_no_other_byte_changes() {
        let dir = std::env::temp_dir().join(format!("sbx-undumpable-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // pstree: pid 7 (field 1), ppid 0 (2), threads [7] (5, packed).
        let pstree = image(0x5027_3030, &[0x08, 7, 0x10, 0, 0x2a, 1, 7]);
        std::fs::write(dir.join("pstree.img"), pstree).unwrap();
        // mm: start_code 0x400000 (1), a vma (14, length-delimited), dumpable 1 (15),
        // thp_disabled 1 (17).
        let entry = [
            0x08, 0x80, 0x80, 0x80, 0x02, 0x72, 3, 0x08, 0x78, 0x01, 0x78, 0x01, 0x88, 0x01, 0x01,
        ];
        let before = image(0x5749_2820, &entry);
        std::fs::write(dir.join("mm-7.img"), &before).unwrap();
        // Another process's image is left alone.
        std::fs::write(dir.join("mm-8.img"), &before).unwrap();
        make_agent_not_dumpable(&dir).unwrap();
        let after = std::fs::read(dir.join("mm-7.img")).unwrap();
        let diff: Vec<usize> = (0..before.len())
            .filter(|i| before[*i] != after[*i])
            .collect();
        // The vma's own bytes `0x78 0x01` (inside field 14) are not the field.
        assert_eq!(diff, vec![12 + 11]);
        assert_eq!(after[12 + 11], 0);
        assert_eq!(std::fs::read(dir.join("mm-8.img")).unwrap(), before);
        // Again: nothing more to do.
        make_agent_not_dumpable(&dir).unwrap();
        assert_eq!(std::fs::read(dir.join("mm-7.img")).unwrap(), after);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn cut_images_are_errors_not_panics() {
        assert!(first_entry(&[1, 2]).is_none());
        assert!(field_varint(&[0x78], MM_DUMPABLE).is_none());
        assert!(field_varint(&[0x72, 9, 1], MM_DUMPABLE).is_none());
    }
}
