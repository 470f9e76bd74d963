//! Checkpoints on disk as Hugging Face lays them out: `config.json` beside `model.safetensors`
//! (or shards listed by `model.safetensors.index.json`'s `weight_map`), tensors in bf16 under
//! DeepSeek's names.
//!
//! A checkpoint is untrusted input. Each file is parsed by `safetensors` (header, offsets and
//! lengths checked against the file), then every tensor the configuration implies is looked
//! up and checked for presence, type (bf16 or f32), shape and finiteness; the first failure is
//! a [`ModelError`] naming the file and the tensor. Tensors the configuration does not use are
//! ignored. Whole files are read into memory (no memory map): meant for models that fit in RAM
//! as f32.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kvroute_kernels::bf16;
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::weights::{self, Model};

/// The configuration's file name.
pub const CONFIG_FILE: &str = "config.json";
/// The single weights file.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The shard index: `{"weight_map": {tensor: file}}`.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.to_owned(),
        source,
    }
}

fn json(path: &Path) -> impl FnOnce(serde_json::Error) -> ModelError + '_ {
    move |source| ModelError::Json {
        path: path.to_owned(),
        source,
    }
}

impl ModelConfig {
    /// Reads and validates `dir/config.json`.
    pub fn load(dir: &Path) -> Result<ModelConfig> {
        let path = dir.join(CONFIG_FILE);
        let text = std::fs::read(&path).map_err(io(&path))?;
        let config: ModelConfig = serde_json::from_slice(&text).map_err(json(&path))?;
        config.validate()?;
        Ok(config)
    }
}

/// The shard index's contents this crate reads.
#[derive(serde::Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

/// The checkpoint's files, read, and which holds each tensor.
struct Files {
    /// `(path, bytes)` per file.
    files: Vec<(PathBuf, Vec<u8>)>,
    /// Tensor name to its file's position in `files`; `None` for a single-file checkpoint.
    map: Option<BTreeMap<String, usize>>,
}

impl Files {
    fn read(dir: &Path) -> Result<Files> {
        let index = dir.join(INDEX_FILE);
        if !index.is_file() {
            let path = dir.join(WEIGHTS_FILE);
            let bytes = std::fs::read(&path).map_err(io(&path))?;
            return Ok(Files {
                files: vec![(path, bytes)],
                map: None,
            });
        }
        let text = std::fs::read(&index).map_err(io(&index))?;
        let parsed: ShardIndex = serde_json::from_slice(&text).map_err(json(&index))?;
        let mut names: Vec<&str> = Vec::new();
        let mut map = BTreeMap::new();
        for (tensor, file) in &parsed.weight_map {
            // A shard is a plain file name beside the index, nothing else.
            let plain = Path::new(file)
                .file_name()
                .is_some_and(|n| n == file.as_str());
            if !plain {
                return Err(ModelError::ShardIndex {
                    path: index,
                    value: file.clone(),
                    why: "a shard must be a file name in the checkpoint's directory",
                });
            }
            let at = match names.iter().position(|n| n == file) {
                Some(at) => at,
                None => {
                    names.push(file);
                    names.len() - 1
                }
            };
            map.insert(tensor.clone(), at);
        }
        let files = names
            .iter()
            .map(|n| {
                let path = dir.join(n);
                let bytes = std::fs::read(&path).map_err(io(&path))?;
                Ok((path, bytes))
            })
            .collect::<Result<_>>()?;
        Ok(Files {
            files,
            map: Some(map),
        })
    }
}

impl Model {
    /// Loads the checkpoint in `dir`: `config.json`, then `model.safetensors` or the shards
    /// `model.safetensors.index.json` lists. Every tensor is checked (presence, bf16 or f32,
    /// shape, finite values) and kept as f32.
    pub fn load(dir: &Path) -> Result<Model> {
        let config = ModelConfig::load(dir)?;
        let files = Files::read(dir)?;
        let parsed: Vec<SafeTensors<'_>> = files
            .files
            .iter()
            .map(|(path, bytes)| {
                SafeTensors::deserialize(bytes).map_err(|source| ModelError::SafeTensors {
                    path: path.clone(),
                    source,
                })
            })
            .collect::<Result<_>>()?;
        let index = dir.join(INDEX_FILE);
        weights::build(config, &mut |name, shape| {
            let at = match &files.map {
                None => 0,
                Some(map) => *map.get(name).ok_or_else(|| ModelError::MissingTensor {
                    file: index.clone(),
                    tensor: name.to_owned(),
                })?,
            };
            let file = &files.files[at].0;
            let view = parsed[at]
                .tensor(name)
                .map_err(|_| ModelError::MissingTensor {
                    file: file.clone(),
                    tensor: name.to_owned(),
                })?;
            read_tensor(file, name, shape, &view)
        })
    }

    /// Writes `dir/config.json` and `dir/model.safetensors` (every tensor in bf16, as
    /// DeepSeek's checkpoints are stored), creating `dir` if needed.
    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let config = dir.join(CONFIG_FILE);
        let text = serde_json::to_vec_pretty(&self.config).map_err(json(&config))?;
        std::fs::write(&config, text).map_err(io(&config))?;
        let tensors = self.tensors();
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .map(|t| {
                t.data
                    .iter()
                    .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
                    .collect()
            })
            .collect();
        let path = dir.join(WEIGHTS_FILE);
        let st = |source| ModelError::SafeTensors {
            path: path.clone(),
            source,
        };
        let views = tensors
            .iter()
            .zip(&bytes)
            .map(|(t, b)| {
                Ok((
                    t.name.clone(),
                    TensorView::new(Dtype::BF16, t.shape.clone(), b)?,
                ))
            })
            .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()
            .map_err(st)?;
        let mut meta = std::collections::HashMap::new();
        meta.insert("format".to_owned(), "pt".to_owned());
        let out = safetensors::serialize(views, Some(meta)).map_err(st)?;
        std::fs::write(&path, out).map_err(io(&path))
    }
}

/// One tensor checked against `shape` and converted to f32.
fn read_tensor(
    file: &Path,
    name: &str,
    shape: &[usize],
    view: &TensorView<'_>,
) -> Result<Vec<f32>> {
    if view.shape() != shape {
        return Err(ModelError::TensorShape {
            file: file.to_owned(),
            tensor: name.to_owned(),
            expected: shape.to_vec(),
            got: view.shape().to_vec(),
        });
    }
    // `safetensors` checked that the data is exactly `shape` elements of its type.
    let data = view.data();
    let values: Vec<f32> = match view.dtype() {
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| bf16::to_f32(u16::from_le_bytes([b[0], b[1]])))
            .collect(),
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        other => {
            return Err(ModelError::TensorDtype {
                file: file.to_owned(),
                tensor: name.to_owned(),
                dtype: format!("{other:?}"),
            });
        }
    };
    if let Some(index) = values.iter().position(|v| !v.is_finite()) {
        return Err(ModelError::NonFiniteWeight {
            file: file.to_owned(),
            tensor: name.to_owned(),
            index,
        });
    }
    Ok(values)
}
