//! A command's output: the last [`CAPACITY`] bytes of stdout and stderr together, with byte
//! positions over both streams in the order they were written.

use std::collections::VecDeque;

use sbx_proto::Stream;

pub const CAPACITY: usize = 16 << 20;

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
        // Appending to the last chunk of the same stream keeps the chunk count low.
        match self.chunks.back_mut() {
            Some(last) if last.stream == stream && last.data.len() < 256 << 10 => {
                last.data.extend_from_slice(data)
            }
            _ => self.chunks.push_back(Chunk {
                pos: self.end,
                stream,
                data: data.to_vec(),
            }),
        }
        self.end += data.len() as u64;
        self.kept += data.len();
        while self.kept > self.cap {
            let over = self.kept - self.cap;
            let Some(front) = self.chunks.front_mut() else {
                break;
            };
            if front.data.len() <= over {
                self.kept -= front.data.len();
                self.chunks.pop_front();
            } else {
                front.data.drain(..over);
                front.pos += over as u64;
                self.kept -= over;
            }
        }
        self.start = self.chunks.front().map(|c| c.pos).unwrap_or(self.end);
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
}
