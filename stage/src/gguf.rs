//! A GGUF file's header, metadata and tensor table, read as candle's
//! `gguf_file::Content::read` reads them, except that the metadata arrays
//! named by the caller are stepped over, only their lengths kept. A
//! tokenizer's vocabulary is most of a model's metadata (SmolLM2's 49,152
//! tokens and 48,900 merges parse into some 11 MB of heap, one allocation
//! each), and a stage that does not tokenize should neither hold it nor
//! have parsed it: parsing and dropping it left glibc keeping megabytes of
//! freed heap for the process's life (its trim threshold follows the
//! largest block freed), measured in docs/BENCHMARKS.md "A stage's memory".
//!
//! Every length is bounded by the `MAX_*` below and by the bytes left in
//! the file before anything is allocated for it.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};

use candle_core::quantized::GgmlDType;
use candle_core::quantized::gguf_file::{
    Content, DEFAULT_ALIGNMENT, TensorInfo, Value, VersionedMagic,
};

/// Most metadata entries, and most tensors, a file may declare.
pub const MAX_GGUF_ENTRIES: u64 = 1 << 20;
/// Longest metadata string or tensor name (a chat template is kilobytes).
pub const MAX_GGUF_STRING: u64 = 64 << 20;
/// Most elements of one metadata array (Gemma 3's vocabulary is 262,144).
pub const MAX_GGUF_ARRAY: u64 = 1 << 26;
/// Deepest nesting of arrays in arrays.
pub const MAX_GGUF_DEPTH: usize = 4;
/// ggml's most dimensions of a tensor.
const MAX_TENSOR_DIMS: u32 = 4;
/// "GGUF", read as a little-endian u32.
const GGUF_MAGIC: u32 = 0x4655_4747;

/// What was read: the content without the arrays stepped over, and each
/// of those arrays' element count by key.
#[derive(Debug)]
pub struct LeanContent {
    pub content: Content,
    pub skipped: HashMap<String, u64>,
}

/// Why the file cannot be read, in words.
type Parse<T> = std::result::Result<T, String>;

/// Read `reader` from its start, stepping over the metadata arrays whose
/// keys are in `skip`.
pub fn read_lean<R: Read + Seek>(reader: R, skip: &[&str]) -> Parse<LeanContent> {
    let mut file = Reader::new(reader)?;
    let magic = file.u32()?;
    if magic != GGUF_MAGIC {
        return Err(format!("unknown magic 0x{magic:08x}"));
    }
    file.magic = match file.u32()? {
        1 => VersionedMagic::GgufV1,
        2 => VersionedMagic::GgufV2,
        3 => VersionedMagic::GgufV3,
        version => return Err(format!("unsupported GGUF version {version}")),
    };
    let tensor_count = file.count("tensors")?;
    let entry_count = file.count("metadata entries")?;
    let mut metadata = HashMap::new();
    let mut skipped = HashMap::new();
    for _ in 0..entry_count {
        let key = file.string()?;
        let kind = file.u32()?;
        if kind == ARRAY && skip.contains(&key.as_str()) {
            let length = file.skip_array(0)?;
            skipped.insert(key, length);
        } else {
            let value = file.value(kind, 0)?;
            metadata.insert(key, value);
        }
    }
    let mut tensor_infos = HashMap::new();
    for _ in 0..tensor_count {
        let name = file.string()?;
        let (name, info) = file.tensor_info(name)?;
        tensor_infos.insert(name, info);
    }
    let alignment = match metadata.get("general.alignment") {
        Some(Value::U8(v)) => u64::from(*v),
        Some(Value::U16(v)) => u64::from(*v),
        Some(Value::U32(v)) => u64::from(*v),
        Some(Value::I8(v)) if *v >= 0 => *v as u64,
        Some(Value::I16(v)) if *v >= 0 => *v as u64,
        Some(Value::I32(v)) if *v >= 0 => *v as u64,
        _ => DEFAULT_ALIGNMENT,
    };
    if alignment == 0 {
        return Err("general.alignment is 0".into());
    }
    let tensor_data_offset = file
        .position
        .div_ceil(alignment)
        .checked_mul(alignment)
        .ok_or("the tensor data's offset overflows")?;
    Ok(LeanContent {
        content: Content {
            magic: file.magic,
            metadata,
            tensor_infos,
            tensor_data_offset,
        },
        skipped,
    })
}

/// GGUF's value types.
const U8: u32 = 0;
const I8: u32 = 1;
const U16: u32 = 2;
const I16: u32 = 3;
const U32: u32 = 4;
const I32: u32 = 5;
const F32: u32 = 6;
const BOOL: u32 = 7;
const STRING: u32 = 8;
const ARRAY: u32 = 9;
const U64: u32 = 10;
const I64: u32 = 11;
const F64: u32 = 12;

/// A value type's bytes when it has a fixed size.
fn fixed_size(kind: u32) -> Option<u64> {
    match kind {
        U8 | I8 | BOOL => Some(1),
        U16 | I16 => Some(2),
        U32 | I32 | F32 => Some(4),
        U64 | I64 | F64 => Some(8),
        _ => None,
    }
}

/// ggml's type ids, as candle's reader maps them.
fn ggml_dtype(id: u32) -> Parse<GgmlDType> {
    Ok(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return Err(format!("unknown dtype for tensor {id}")),
    })
}

struct Reader<R> {
    inner: R,
    position: u64,
    size: u64,
    magic: VersionedMagic,
}

impl<R: Read + Seek> Reader<R> {
    fn new(mut inner: R) -> Parse<Self> {
        let size = inner.seek(SeekFrom::End(0)).map_err(|e| e.to_string())?;
        inner.seek(SeekFrom::Start(0)).map_err(|e| e.to_string())?;
        Ok(Self {
            inner,
            position: 0,
            size,
            magic: VersionedMagic::GgufV3,
        })
    }

    fn left(&self) -> u64 {
        self.size.saturating_sub(self.position)
    }

    fn bytes<const N: usize>(&mut self) -> Parse<[u8; N]> {
        if self.left() < N as u64 {
            return Err(format!("truncated at byte {}", self.position));
        }
        let mut bytes = [0u8; N];
        self.inner
            .read_exact(&mut bytes)
            .map_err(|e| e.to_string())?;
        self.position += N as u64;
        Ok(bytes)
    }

    fn u32(&mut self) -> Parse<u32> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }

    fn u64(&mut self) -> Parse<u64> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }

    /// A length or count: u32 in version 1, u64 after.
    fn length(&mut self) -> Parse<u64> {
        match self.magic {
            VersionedMagic::GgufV1 => Ok(u64::from(self.u32()?)),
            VersionedMagic::GgufV2 | VersionedMagic::GgufV3 => self.u64(),
        }
    }

    fn count(&mut self, what: &str) -> Parse<u64> {
        let count = self.length()?;
        if count > MAX_GGUF_ENTRIES || count > self.left() {
            return Err(format!("{count} {what} declared, more than the file holds"));
        }
        Ok(count)
    }

    fn skip(&mut self, bytes: u64) -> Parse<()> {
        if bytes > self.left() {
            return Err(format!("truncated at byte {}", self.position));
        }
        let step = i64::try_from(bytes).map_err(|e| e.to_string())?;
        self.inner.seek_relative(step).map_err(|e| e.to_string())?;
        self.position += bytes;
        Ok(())
    }

    fn string(&mut self) -> Parse<String> {
        let length = self.length()?;
        if length > MAX_GGUF_STRING || length > self.left() {
            return Err(format!(
                "a string of {length} bytes at byte {}",
                self.position
            ));
        }
        let mut bytes = vec![0u8; length as usize];
        self.inner
            .read_exact(&mut bytes)
            .map_err(|e| e.to_string())?;
        self.position += length;
        // As candle reads them: trailing NULs dropped, invalid UTF-8 replaced.
        while bytes.last() == Some(&0) {
            bytes.pop();
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// An array's element type and length, checked against the file.
    fn array_head(&mut self, depth: usize) -> Parse<(u32, u64)> {
        if depth >= MAX_GGUF_DEPTH {
            return Err("arrays nested too deep".into());
        }
        let kind = self.u32()?;
        if kind > F64 {
            return Err(format!("unknown value type {kind}"));
        }
        let length = self.length()?;
        let least = fixed_size(kind).unwrap_or(match self.magic {
            VersionedMagic::GgufV1 => 4,
            VersionedMagic::GgufV2 | VersionedMagic::GgufV3 => 8,
        });
        if length > MAX_GGUF_ARRAY || length.saturating_mul(least) > self.left() {
            return Err(format!(
                "an array of {length} elements at byte {}",
                self.position
            ));
        }
        Ok((kind, length))
    }

    /// Step over an array's elements; its length.
    fn skip_array(&mut self, depth: usize) -> Parse<u64> {
        let (kind, length) = self.array_head(depth)?;
        match (kind, fixed_size(kind)) {
            (_, Some(size)) => self.skip(length * size)?,
            (STRING, None) => {
                for _ in 0..length {
                    let bytes = self.length()?;
                    self.skip(bytes)?;
                }
            }
            (ARRAY, None) => {
                for _ in 0..length {
                    self.skip_array(depth + 1)?;
                }
            }
            _ => return Err(format!("unknown value type {kind}")),
        }
        Ok(length)
    }

    fn value(&mut self, kind: u32, depth: usize) -> Parse<Value> {
        Ok(match kind {
            U8 => Value::U8(self.bytes::<1>()?[0]),
            I8 => Value::I8(i8::from_le_bytes(self.bytes()?)),
            U16 => Value::U16(u16::from_le_bytes(self.bytes()?)),
            I16 => Value::I16(i16::from_le_bytes(self.bytes()?)),
            U32 => Value::U32(self.u32()?),
            I32 => Value::I32(i32::from_le_bytes(self.bytes()?)),
            F32 => Value::F32(f32::from_le_bytes(self.bytes()?)),
            U64 => Value::U64(self.u64()?),
            I64 => Value::I64(i64::from_le_bytes(self.bytes()?)),
            F64 => Value::F64(f64::from_le_bytes(self.bytes()?)),
            BOOL => match self.bytes::<1>()?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                other => return Err(format!("a bool of {other}")),
            },
            STRING => Value::String(self.string()?),
            ARRAY => {
                let (kind, length) = self.array_head(depth)?;
                // Grown as elements are read: a length is only a claim.
                let mut values = Vec::with_capacity(length.min(1024) as usize);
                for _ in 0..length {
                    values.push(self.value(kind, depth + 1)?);
                }
                Value::Array(values)
            }
            other => return Err(format!("unknown value type {other}")),
        })
    }

    fn tensor_info(&mut self, name: String) -> Parse<(String, TensorInfo)> {
        let dims = self.u32()?;
        if dims > MAX_TENSOR_DIMS {
            return Err(format!("tensor `{name}` has {dims} dimensions"));
        }
        let mut shape = Vec::with_capacity(dims as usize);
        for _ in 0..dims {
            let dim = match self.magic {
                VersionedMagic::GgufV1 => u64::from(self.u32()?),
                VersionedMagic::GgufV2 | VersionedMagic::GgufV3 => self.u64()?,
            };
            shape.push(usize::try_from(dim).map_err(|e| e.to_string())?);
        }
        shape.reverse();
        // Its element count is multiplied out wherever its size is asked.
        if shape
            .iter()
            .try_fold(1usize, |n, d| n.checked_mul(*d))
            .is_none()
        {
            return Err(format!("tensor `{name}`: its dimensions overflow"));
        }
        let ggml_dtype = ggml_dtype(self.u32()?)?;
        let offset = self.u64()?;
        Ok((
            name,
            TensorInfo {
                ggml_dtype,
                shape: candle_core::Shape::from(shape),
                offset,
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::{SyntheticSpec, write_synthetic};
    use proptest::prelude::*;

    /// The synthetic model's GGUF file, written once.
    fn synthetic_gguf() -> &'static [u8] {
        static BYTES: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
        BYTES.get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let model =
                write_synthetic(dir.path(), &SyntheticSpec::default(), &[GgmlDType::Q8_0]).unwrap();
            std::fs::read(model.gguf(GgmlDType::Q8_0).unwrap()).unwrap()
        })
    }

    /// What candle reads, less the keys skipped, and the lengths of those.
    pub(crate) fn agrees_with_candle(bytes: &[u8], skip: &[&str]) {
        let whole = Content::read(&mut std::io::Cursor::new(bytes)).unwrap();
        let lean = read_lean(std::io::Cursor::new(bytes), skip).unwrap();
        assert_eq!(lean.content.magic, whole.magic);
        assert_eq!(lean.content.tensor_data_offset, whole.tensor_data_offset);
        assert_eq!(
            lean.content.metadata.len() + lean.skipped.len(),
            whole.metadata.len()
        );
        for (key, value) in &whole.metadata {
            match lean.content.metadata.get(key) {
                Some(kept) => assert_eq!(format!("{kept:?}"), format!("{value:?}"), "{key}"),
                None => {
                    let Value::Array(elements) = value else {
                        panic!("{key} skipped but not an array")
                    };
                    assert!(skip.contains(&key.as_str()));
                    assert_eq!(lean.skipped[key], elements.len() as u64);
                }
            }
        }
        assert_eq!(lean.content.tensor_infos.len(), whole.tensor_infos.len());
        for (name, info) in &whole.tensor_infos {
            let mine = &lean.content.tensor_infos[name];
            assert_eq!(mine.ggml_dtype, info.ggml_dtype, "{name}");
            assert_eq!(mine.shape, info.shape, "{name}");
            assert_eq!(mine.offset, info.offset, "{name}");
        }
    }

    #[test]
    fn reads_what_candle_reads_less_the_arrays_skipped() {
        let bytes = synthetic_gguf();
        agrees_with_candle(bytes, &[]);
        agrees_with_candle(bytes, &crate::source::VOCABULARY_KEYS);
    }

    /// The two real models, where the test machine has them.
    #[test]
    fn reads_the_real_models_as_candle_does() {
        for var in ["MESH_SMOLLM2_GGUF", "MESH_GEMMA3_GGUF"] {
            let Some(path) = std::env::var_os(var) else {
                eprintln!("{var} is not set: that model's check is skipped");
                continue;
            };
            let bytes = std::fs::read(path).unwrap();
            agrees_with_candle(&bytes, &crate::source::VOCABULARY_KEYS);
        }
    }

    #[test]
    fn a_truncated_or_padded_header_is_refused_or_read_the_same() {
        let bytes = synthetic_gguf();
        let whole = read_lean(std::io::Cursor::new(bytes), &[]).unwrap();
        let header_end = whole.content.tensor_data_offset as usize;
        let mut refused = 0;
        for cut in 0..header_end {
            match read_lean(std::io::Cursor::new(&bytes[..cut]), &[]) {
                Err(_) => refused += 1,
                // Only the alignment padding after the tensor table may go.
                Ok(read) => {
                    assert_eq!(
                        read.content.tensor_data_offset,
                        whole.content.tensor_data_offset
                    );
                    assert_eq!(
                        read.content.tensor_infos.len(),
                        whole.content.tensor_infos.len()
                    );
                }
            }
        }
        assert!(
            refused + 32 >= header_end,
            "{refused} of {header_end} cuts refused"
        );
        assert!(read_lean(std::io::Cursor::new(b"GGUF\x09\0\0\0"), &[]).is_err());
        assert!(read_lean(std::io::Cursor::new(b"GGML\x03\0\0\0"), &[]).is_err());
    }

    /// A version 3 header of `tensors` and `entries`, then `body`.
    fn gguf_v3(tensors: u64, entries: u64, body: &[u8]) -> Vec<u8> {
        let mut bytes = b"GGUF".to_vec();
        bytes.extend_from_slice(&3u32.to_le_bytes());
        bytes.extend_from_slice(&tensors.to_le_bytes());
        bytes.extend_from_slice(&entries.to_le_bytes());
        bytes.extend_from_slice(body);
        bytes.resize(bytes.len() + 64, 0);
        bytes
    }

    fn gguf_string(text: &str) -> Vec<u8> {
        let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(text.as_bytes());
        bytes
    }

    /// What candle refuses, or would compute wrongly from, is refused: an
    /// array of an unknown type (even empty), dimensions whose product
    /// overflows, an alignment of 0.
    #[test]
    fn unknown_types_overflowing_shapes_and_zero_alignment_are_refused() {
        let mut array = gguf_string("k");
        array.extend_from_slice(&ARRAY.to_le_bytes());
        array.extend_from_slice(&99u32.to_le_bytes());
        array.extend_from_slice(&0u64.to_le_bytes());
        let refused = read_lean(std::io::Cursor::new(gguf_v3(0, 1, &array)), &[]).unwrap_err();
        assert!(refused.contains("unknown value type 99"), "{refused}");

        let mut tensor = gguf_string("t");
        tensor.extend_from_slice(&2u32.to_le_bytes());
        tensor.extend_from_slice(&u64::MAX.to_le_bytes());
        tensor.extend_from_slice(&2u64.to_le_bytes());
        tensor.extend_from_slice(&0u32.to_le_bytes());
        tensor.extend_from_slice(&0u64.to_le_bytes());
        let refused = read_lean(std::io::Cursor::new(gguf_v3(1, 0, &tensor)), &[]).unwrap_err();
        assert!(refused.contains("overflow"), "{refused}");

        let mut alignment = gguf_string("general.alignment");
        alignment.extend_from_slice(&U32.to_le_bytes());
        alignment.extend_from_slice(&0u32.to_le_bytes());
        let refused = read_lean(std::io::Cursor::new(gguf_v3(0, 1, &alignment)), &[]).unwrap_err();
        assert!(refused.contains("alignment"), "{refused}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Any byte of the header changed, or garbage: an answer, never a
        /// panic or an allocation past the file's size.
        #[test]
        fn any_altered_header_gives_an_answer(at in 0usize..4096, byte in any::<u8>()) {
            let mut bytes = synthetic_gguf().to_vec();
            let at = at % bytes.len();
            bytes[at] = byte;
            let _ = read_lean(std::io::Cursor::new(&bytes), &crate::source::VOCABULARY_KEYS);
        }

        #[test]
        fn garbage_gives_an_answer(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut prefixed = b"GGUF\x03\0\0\0".to_vec();
            prefixed.extend_from_slice(&bytes);
            let _ = read_lean(std::io::Cursor::new(&prefixed), &[]);
        }
    }
}
