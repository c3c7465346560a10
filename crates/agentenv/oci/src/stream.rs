//! The byte stream of a layer: decompression (none, gzip, zstd) and the running sha256 of the
//! uncompressed tar (its diff_id).

use std::io::{self, BufRead, BufReader, Read};

use sha2::{Digest as _, Sha256};

use crate::manifest::Compression;
use crate::reference::Digest;

/// The uncompressed tar of `blob`, hashed as it is read.
pub(crate) fn decoder<'a>(
    blob: impl Read + 'a,
    compression: Compression,
) -> io::Result<HashingReader<Box<dyn Read + 'a>>> {
    let buffered = BufReader::with_capacity(256 << 10, blob);
    let tar: Box<dyn Read + 'a> = match compression {
        Compression::None => Box::new(buffered),
        Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(buffered)),
        Compression::Zstd => Box::new(ZstdFrames::new(buffered)?),
    };
    Ok(HashingReader {
        inner: tar,
        hash: Sha256::new(),
    })
}

/// A reader that hashes what passes through it.
pub(crate) struct HashingReader<R> {
    inner: R,
    hash: Sha256,
}

impl<R> HashingReader<R> {
    /// The digest of everything read so far.
    pub(crate) fn digest(self) -> Digest {
        Digest::from_hasher(self.hash)
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
}

/// A zstd stream of one or more frames.
struct ZstdFrames<R: BufRead> {
    dec: Option<ruzstd::decoding::StreamingDecoder<R, ruzstd::decoding::FrameDecoder>>,
}

impl<R: BufRead> ZstdFrames<R> {
    fn new(src: R) -> io::Result<Self> {
        let dec = ruzstd::decoding::StreamingDecoder::new(src)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        Ok(ZstdFrames { dec: Some(dec) })
    }
}

impl<R: BufRead> Read for ZstdFrames<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let Some(dec) = self.dec.as_mut() else {
                return Ok(0);
            };
            let n = dec.read(buf)?;
            if n > 0 || buf.is_empty() {
                return Ok(n);
            }
            let Some(dec) = self.dec.take() else {
                return Ok(0);
            };
            let mut src = dec.into_inner();
            if src.fill_buf()?.is_empty() {
                return Ok(0);
            }
            *self = ZstdFrames::new(src)?;
        }
    }
}
