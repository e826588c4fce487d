//! A command's output: the last [`CAPACITY`] bytes of stdout and stderr together, with byte
//! positions over both streams in the order they were written.

use std::collections::VecDeque;

use sbx_proto::Stream;

pub const CAPACITY: usize = 16 << 20;
/// The largest piece the ring keeps output in.
const CHUNK: usize = 256 << 10;

#[derive(Debug)]
struct Chunk {
    pos: u64,
    stream: Stream,
    data: Vec<u8>,
}

#[derive(Debug)]
pub struct Ring {
    chunks: VecDeque<Chunk>,
    cap: usize,
    kept: usize,
    start: u64,
    end: u64,
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
}

/// A piece of output to send: where it starts, which stream, the bytes.
#[cfg(test)]
pub type Piece = (u64, Stream, Vec<u8>);

impl Ring {
    pub fn new(cap: usize) -> Ring {
        Ring {
            chunks: VecDeque::new(),
            cap,
            kept: 0,
            start: 0,
            end: 0,
            stdout_bytes: 0,
            stderr_bytes: 0,
        }
    }

    pub fn start(&self) -> u64 {
        self.start
    }

    pub fn end(&self) -> u64 {
        self.end
    }

    pub fn push(&mut self, stream: Stream, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        match stream {
            Stream::Stderr => self.stderr_bytes += data.len() as u64,
            _ => self.stdout_bytes += data.len() as u64,
        }
        // Appending to the last chunk of the same stream keeps the chunk count low. A chunk is
        // allocated at its first bytes' size, then at most once more, at [`CHUNK`]: two sizes
        // of allocation, which the allocator reuses as chunks come and go (growing by doubling
        // left holes of every size behind).
        let mut rest = data;
        while !rest.is_empty() {
            let pos = self.end + (data.len() - rest.len()) as u64;
            match self.chunks.back_mut() {
                Some(last) if last.stream == stream && last.data.len() < CHUNK => {
                    let take = (CHUNK - last.data.len()).min(rest.len());
                    if last.data.capacity() < last.data.len() + take {
                        last.data.reserve_exact(CHUNK - last.data.len());
                    }
                    last.data.extend_from_slice(&rest[..take]);
                    rest = &rest[take..];
                }
                _ => {
                    let take = rest.len().min(CHUNK);
                    self.chunks.push_back(Chunk {
                        pos,
                        stream,
                        data: rest[..take].to_vec(),
                    });
                    rest = &rest[take..];
                }
            }
        }
        self.end += data.len() as u64;
        self.kept += data.len();
        self.trim_to(self.cap);
    }

    /// How many bytes are kept.
    pub fn kept(&self) -> usize {
        self.kept
    }

    /// Drops the oldest bytes until at most `keep` are kept; what is dropped is given back to
    /// the allocator (a chunk cut in part is reallocated to its rest).
    pub fn trim_to(&mut self, keep: usize) {
        while self.kept > keep {
            let over = self.kept - keep;
            let Some(front) = self.chunks.front_mut() else {
                break;
            };
            if front.data.len() <= over {
                self.kept -= front.data.len();
                self.chunks.pop_front();
            } else {
                front.data.drain(..over);
                front.data.shrink_to_fit();
                front.pos += over as u64;
                self.kept -= over;
            }
        }
        self.start = self.chunks.front().map(|c| c.pos).unwrap_or(self.end);
    }

    /// Gives back the room the last chunk kept for more output (when no more will come).
    pub fn shrink(&mut self) {
        if let Some(last) = self.chunks.back_mut() {
            last.data.shrink_to_fit();
        }
    }

    /// The bytes from `from` on (clamped to what is kept), at most `max` of them.
    #[cfg(test)]
    pub fn read_from(&self, from: u64, max: usize) -> Vec<Piece> {
        self.read_with(from, max, |_, _, data| data.to_vec())
            .into_iter()
            .map(|(pos, stream, _, data)| (pos, stream, data))
            .collect()
    }

    /// The bytes from `from` on (clamped to what is kept), at most `max` of them, each run of
    /// one chunk handed to `f` as a slice of the ring (so that a frame is built without an
    /// intermediate copy): `(position, stream, length, f's value)`.
    pub fn read_with<T>(
        &self,
        from: u64,
        max: usize,
        mut f: impl FnMut(u64, Stream, &[u8]) -> T,
    ) -> Vec<(u64, Stream, usize, T)> {
        let mut out = Vec::new();
        let mut budget = max;
        let from = from.max(self.start);
        for c in &self.chunks {
            let c_end = c.pos + c.data.len() as u64;
            if c_end <= from {
                continue;
            }
            if budget == 0 {
                break;
            }
            let skip = from.saturating_sub(c.pos) as usize;
            let take = (c.data.len() - skip).min(budget);
            let pos = c.pos + skip as u64;
            let slice = &c.data[skip..skip + take];
            out.push((pos, c.stream, take, f(pos, c.stream, slice)));
            budget -= take;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_positions_over_both_streams() {
        let mut r = Ring::new(10);
        r.push(Stream::Stdout, b"abc");
        r.push(Stream::Stderr, b"de");
        r.push(Stream::Stdout, b"f");
        assert_eq!((r.start(), r.end()), (0, 6));
        let p = r.read_from(2, usize::MAX);
        assert_eq!(
            p,
            vec![
                (2, Stream::Stdout, b"c".to_vec()),
                (3, Stream::Stderr, b"de".to_vec()),
                (5, Stream::Stdout, b"f".to_vec())
            ]
        );
        assert_eq!((r.stdout_bytes, r.stderr_bytes), (4, 2));
    }

    #[test]
    fn drops_oldest_bytes_beyond_capacity() {
        let mut r = Ring::new(4);
        r.push(Stream::Stdout, b"0123");
        r.push(Stream::Stderr, b"45");
        assert_eq!((r.start(), r.end()), (2, 6));
        let p = r.read_from(0, usize::MAX);
        assert_eq!(
            p,
            vec![
                (2, Stream::Stdout, b"23".to_vec()),
                (4, Stream::Stderr, b"45".to_vec())
            ]
        );
        assert_eq!(r.read_from(5, 1), vec![(5, Stream::Stderr, b"5".to_vec())]);
        assert_eq!(r.stdout_bytes, 4);
    }

    #[test]
    fn large_writes_are_kept_in_chunks_of_one_size() {
        let mut r = Ring::new(CAPACITY);
        r.push(Stream::Stdout, b"ab");
        r.push(Stream::Stdout, &vec![b'c'; CHUNK + 10]);
        r.push(Stream::Stderr, b"de");
        assert!(r.chunks.iter().all(|c| c.data.len() <= CHUNK));
        assert!(r.chunks.iter().all(|c| c.data.capacity() <= CHUNK));
        assert_eq!(r.chunks.len(), 3);
        assert_eq!(
            (r.chunks[1].pos, r.chunks[2].pos),
            (CHUNK as u64, CHUNK as u64 + 12)
        );
        let all: Vec<u8> = r
            .read_from(0, usize::MAX)
            .into_iter()
            .flat_map(|(_, _, d)| d)
            .collect();
        assert_eq!(all.len(), CHUNK + 14);
        assert_eq!(&all[..3], b"abc");
        assert_eq!(&all[CHUNK + 12..], b"de");
    }

    #[test]
    fn trims_to_a_tail() {
        let mut r = Ring::new(100);
        r.push(Stream::Stdout, b"0123");
        r.push(Stream::Stderr, b"456");
        r.push(Stream::Stdout, b"789");
        r.trim_to(4);
        assert_eq!((r.start(), r.end(), r.kept()), (6, 10, 4));
        assert_eq!(
            r.read_from(0, usize::MAX),
            vec![
                (6, Stream::Stderr, b"6".to_vec()),
                (7, Stream::Stdout, b"789".to_vec())
            ]
        );
        r.trim_to(0);
        assert_eq!((r.start(), r.end(), r.kept()), (10, 10, 0));
        assert!(r.read_from(0, usize::MAX).is_empty());
        assert_eq!((r.stdout_bytes, r.stderr_bytes), (7, 3));
    }
}
