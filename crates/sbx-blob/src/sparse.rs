//! A file written with holes where the stream has zeros (a disk image's unused blocks), so that
//! a sparse file uploaded whole comes back sparse.

use std::fs::File;
use std::io::{self, Seek, SeekFrom, Write};

/// The granularity of holes: a filesystem's block.
const BLOCK: u64 = 4096;

pub(crate) struct SparseWriter {
    file: File,
    /// The logical position (what was written or skipped).
    pos: u64,
    /// Where the file's cursor is.
    at: u64,
}

impl SparseWriter {
    pub fn new(file: File) -> Self {
        SparseWriter {
            file,
            pos: 0,
            at: 0,
        }
    }

    /// Sets the length (a trailing hole), syncs, and hands the file back.
    pub fn finish(self) -> io::Result<File> {
        self.file.set_len(self.pos)?;
        self.file.sync_all()?;
        Ok(self.file)
    }
}

impl Write for SparseWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            // Up to the next block boundary of the file.
            let room = usize::try_from(BLOCK - self.pos % BLOCK).unwrap_or(usize::MAX);
            let n = room.min(buf.len() - done);
            let piece = &buf[done..done + n];
            if !piece.iter().all(|b| *b == 0) {
                if self.at != self.pos {
                    self.file.seek(SeekFrom::Start(self.pos))?;
                    self.at = self.pos;
                }
                self.file.write_all(piece)?;
                self.at += n as u64;
            }
            self.pos += n as u64;
            done += n;
        }
        Ok(done)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn zeros_become_holes_and_the_content_is_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        let mut want = vec![0u8; 8 << 20];
        want[5 << 20..(5 << 20) + 10_000].fill(7);
        want[100] = 1;
        let mut w = SparseWriter::new(File::create(&path).unwrap());
        // Odd-sized writes, across block boundaries.
        for chunk in want.chunks(12_345) {
            w.write_all(chunk).unwrap();
        }
        w.finish().unwrap();
        let mut got = Vec::new();
        File::open(&path).unwrap().read_to_end(&mut got).unwrap();
        assert_eq!(got.len(), want.len());
        assert!(got == want, "the content changed");
        let blocks = std::fs::metadata(&path).unwrap().blocks() * 512;
        assert!(
            blocks < 1 << 20,
            "{blocks} bytes allocated for 16 KiB of data"
        );
    }
}
