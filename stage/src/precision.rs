//! What a forward pass ran at, as a receipt's `precision` names it: the
//! file's own quantization (its GGUF `general.file_type`), the stored types
//! of the tensors that ran, how products were formed, the device and the
//! wire format of the frames. Two receipts name the same precision only
//! when all of these are the same, so a weights change record's precision
//! list tells a Q4_1 file from a Q4_K_M one, a CPU from a GPU, and an f32
//! wire from an f16 one.
//!
//! The text is `<file type> (<stored>); products <p>; device <d>; wire <w>`,
//! the file type and its parentheses left out when the file declares none,
//! e.g. `q4_k_m (f32+q4_k+q5_0+q6_k+q8_0); products q8/f32; device cpu; wire f32`.

use std::collections::BTreeSet;
use std::fmt;

use candle_core::quantized::GgmlDType;

use crate::frame::WireDType;

/// How the matrix products of a pass were formed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Products {
    /// Stored blocks against activations quantized to 8 bits (ggml's
    /// `vec_dot` types: q8_0, q8_1, q8_K), accumulated in f32.
    BlocksQ8,
    /// Every matrix dense in f32 (an f32 or f16 file, or a quantized one
    /// dequantized at load).
    DenseF32,
}

impl Products {
    pub fn as_str(self) -> &'static str {
        match self {
            Products::BlocksQ8 => "q8/f32",
            Products::DenseF32 => "f32",
        }
    }
}

/// A pass's precision (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Precision {
    /// The file's declared quantization, e.g. `q4_k_m`.
    pub file_type: Option<&'static str>,
    /// The stored type of every tensor that ran, e.g. `q4_k`, `f32`.
    pub stored: BTreeSet<&'static str>,
    pub products: Products,
    /// `cpu`, `cuda:0`, `metal:0`.
    pub device: String,
    pub wire: WireDType,
}

impl Precision {
    /// The products a pass over `stored` forms: blocks whenever a block
    /// type ran as stored.
    pub fn products_of(stored: &BTreeSet<&'static str>, dense_f32: bool) -> Products {
        let blocks = stored
            .iter()
            .any(|name| !matches!(*name, "f32" | "f16" | "bf16"));
        if blocks && !dense_f32 {
            Products::BlocksQ8
        } else {
            Products::DenseF32
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stored = self.stored.iter().copied().collect::<Vec<_>>().join("+");
        match self.file_type {
            Some(file_type) => write!(f, "{file_type} ({stored})")?,
            None => f.write_str(&stored)?,
        }
        write!(
            f,
            "; products {}; device {}; wire {}",
            self.products.as_str(),
            self.device,
            self.wire.name()
        )
    }
}

/// ggml's name of a stored type.
pub fn type_name(dtype: GgmlDType) -> &'static str {
    match dtype {
        GgmlDType::F32 => "f32",
        GgmlDType::F16 => "f16",
        GgmlDType::BF16 => "bf16",
        GgmlDType::Q4_0 => "q4_0",
        GgmlDType::Q4_1 => "q4_1",
        GgmlDType::Q5_0 => "q5_0",
        GgmlDType::Q5_1 => "q5_1",
        GgmlDType::Q8_0 => "q8_0",
        GgmlDType::Q8_1 => "q8_1",
        GgmlDType::Q2K => "q2_k",
        GgmlDType::Q3K => "q3_k",
        GgmlDType::Q4K => "q4_k",
        GgmlDType::Q5K => "q5_k",
        GgmlDType::Q6K => "q6_k",
        GgmlDType::Q8K => "q8_k",
    }
}

/// The name of a dense tensor's type (a safetensors model's: F32, F16 or
/// BF16).
pub fn dense_name(dtype: candle_core::DType) -> &'static str {
    match dtype {
        candle_core::DType::F16 => "f16",
        candle_core::DType::BF16 => "bf16",
        _ => "f32",
    }
}

/// The name of a GGUF `general.file_type` (llama.cpp's `llama_ftype`), for
/// the types this engine runs; `None` for any other value.
pub fn file_type_name(code: u32) -> Option<&'static str> {
    Some(match code {
        0 => "f32",
        1 => "f16",
        2 => "q4_0",
        3 => "q4_1",
        7 => "q8_0",
        8 => "q5_0",
        9 => "q5_1",
        10 => "q2_k",
        11 => "q3_k_s",
        12 => "q3_k_m",
        13 => "q3_k_l",
        14 => "q4_k_s",
        15 => "q4_k_m",
        16 => "q5_k_s",
        17 => "q5_k_m",
        18 => "q6_k",
        21 => "q2_k_s",
        32 => "bf16",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_names_every_part_and_tells_files_devices_and_wires_apart() {
        let q4_1 = Precision {
            file_type: file_type_name(3),
            stored: ["q4_1", "f32", "q8_0"].into_iter().collect(),
            products: Products::BlocksQ8,
            device: "cpu".into(),
            wire: WireDType::F32,
        };
        assert_eq!(
            q4_1.to_string(),
            "q4_1 (f32+q4_1+q8_0); products q8/f32; device cpu; wire f32"
        );
        let q4_k_m = Precision {
            file_type: file_type_name(15),
            stored: ["q4_k", "q6_k", "f32"].into_iter().collect(),
            ..q4_1.clone()
        };
        assert!(q4_k_m.to_string().starts_with("q4_k_m (f32+q4_k+q6_k)"));
        let gpu = Precision {
            device: "cuda:0".into(),
            ..q4_1.clone()
        };
        let f16_wire = Precision {
            wire: WireDType::F16,
            ..q4_1.clone()
        };
        let texts: BTreeSet<String> = [&q4_1, &q4_k_m, &gpu, &f16_wire]
            .iter()
            .map(|p| p.to_string())
            .collect();
        assert_eq!(texts.len(), 4);
        let undeclared = Precision {
            file_type: None,
            stored: ["f32"].into_iter().collect(),
            products: Products::DenseF32,
            ..q4_1
        };
        assert_eq!(
            undeclared.to_string(),
            "f32; products f32; device cpu; wire f32"
        );
    }

    #[test]
    fn products_are_blocks_only_when_a_block_type_ran_as_stored() {
        let dense: BTreeSet<&str> = ["f32", "f16"].into_iter().collect();
        assert_eq!(Precision::products_of(&dense, false), Products::DenseF32);
        let blocks: BTreeSet<&str> = ["f32", "q4_1"].into_iter().collect();
        assert_eq!(Precision::products_of(&blocks, false), Products::BlocksQ8);
        assert_eq!(Precision::products_of(&blocks, true), Products::DenseF32);
        assert_eq!(file_type_name(4), None);
    }
}
