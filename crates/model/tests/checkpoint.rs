//! Checkpoints: what is saved loads back to the same model, single-file or sharded, bf16 or
//! f32; and every corruption of a file is refused with an error naming the file and tensor.

// Test helpers panic on failure: that is how a test reports it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::{Scratch, small_config};
use kvroute_model::{Model, ModelError, WEIGHTS_FILE};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

fn logits_of(model: &Model) -> Vec<f32> {
    let hidden = model
        .prefill_with_hidden(&[3, 9, 27, 81], &[0, 1, 2, 3])
        .unwrap()
        .hidden;
    model.logits(&hidden).unwrap()
}

/// The saved file's tensors, owned: `(name, dtype, shape, bytes)`.
fn read_all(path: &Path) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect()
}

fn write_all(path: &Path, tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// Saves a small model to a scratch directory, rewrites its weights file with `edit`, and
/// loads it.
fn load_edited(
    name: &str,
    edit: impl FnOnce(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>),
) -> Result<Model, ModelError> {
    let dir = Scratch::new(name);
    Model::init(small_config(), 5)
        .unwrap()
        .save(&dir.0)
        .unwrap();
    let path = dir.0.join(WEIGHTS_FILE);
    let mut tensors = read_all(&path);
    edit(&mut tensors);
    write_all(&path, &tensors);
    Model::load(&dir.0)
}

const KV_B: &str = "model.layers.1.self_attn.kv_b_proj.weight";

#[test]
fn a_saved_model_loads_back_to_bit_identical_logits() {
    let dir = Scratch::new("roundtrip");
    let model = Model::init(small_config(), 5).unwrap();
    model.save(&dir.0).unwrap();
    let loaded = Model::load(&dir.0).unwrap();
    assert_eq!(loaded.config(), model.config());
    assert_eq!(logits_of(&loaded), logits_of(&model));
    let names: Vec<String> = read_all(&dir.0.join(WEIGHTS_FILE))
        .into_iter()
        .map(|t| t.0)
        .collect();
    for name in [
        "model.embed_tokens.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.experts.3.down_proj.weight",
        "model.layers.1.mlp.shared_experts.up_proj.weight",
        "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.1.self_attn.kv_a_layernorm.weight",
        "lm_head.weight",
    ] {
        assert!(names.iter().any(|n| n == name), "{name} not saved");
    }
    assert_eq!(names.len(), model.tensors().len());
}

#[test]
fn f32_tensors_load_as_the_same_values() {
    let model = load_edited("f32", |ts| {
        for (_, dtype, _, bytes) in ts.iter_mut() {
            *dtype = Dtype::F32;
            *bytes = bytes
                .chunks_exact(2)
                .flat_map(|b| (u32::from(u16::from_le_bytes([b[0], b[1]])) << 16).to_le_bytes())
                .collect();
        }
    })
    .unwrap();
    let reference = Model::init(small_config(), 5).unwrap();
    assert_eq!(logits_of(&model), logits_of(&reference));
}

#[test]
fn a_sharded_checkpoint_loads_through_its_index() {
    let dir = Scratch::new("sharded");
    let model = Model::init(small_config(), 5).unwrap();
    model.save(&dir.0).unwrap();
    let single = dir.0.join(WEIGHTS_FILE);
    let tensors = read_all(&single);
    std::fs::remove_file(&single).unwrap();
    let (a, b) = tensors.split_at(tensors.len() / 2);
    write_all(&dir.0.join("model-00001-of-00002.safetensors"), a);
    write_all(&dir.0.join("model-00002-of-00002.safetensors"), b);
    let mut map = HashMap::new();
    for (t, file) in [
        (a, "model-00001-of-00002.safetensors"),
        (b, "model-00002-of-00002.safetensors"),
    ] {
        for (name, ..) in t {
            map.insert(name.clone(), file);
        }
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": map });
    std::fs::write(
        dir.0.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    assert_eq!(logits_of(&Model::load(&dir.0).unwrap()), logits_of(&model));

    // A shard outside the directory is refused before anything is read.
    let mut bad = map.clone();
    bad.insert(KV_B.to_owned(), "../model-00001-of-00002.safetensors");
    let index = serde_json::json!({ "weight_map": bad });
    std::fs::write(
        dir.0.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let err = Model::load(&dir.0).unwrap_err();
    assert!(matches!(err, ModelError::ShardIndex { .. }), "{err}");

    // A tensor the index does not list is missing, and the error names the index.
    map.remove(KV_B);
    let index = serde_json::json!({ "weight_map": map });
    std::fs::write(
        dir.0.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    match Model::load(&dir.0).unwrap_err() {
        ModelError::MissingTensor { file, tensor } => {
            assert_eq!(tensor, KV_B);
            assert!(file.ends_with("model.safetensors.index.json"));
        }
        other => panic!("{other}"),
    }
}

#[test]
fn a_truncated_file_is_refused_as_malformed() {
    let dir = Scratch::new("truncated");
    Model::init(small_config(), 5)
        .unwrap()
        .save(&dir.0)
        .unwrap();
    let path = dir.0.join(WEIGHTS_FILE);
    let bytes = std::fs::read(&path).unwrap();
    for keep in [bytes.len() - 1, bytes.len() / 2, 100, 7, 0] {
        std::fs::write(&path, &bytes[..keep]).unwrap();
        let err = Model::load(&dir.0).unwrap_err();
        assert!(
            matches!(&err, ModelError::SafeTensors { path: p, .. } if *p == path),
            "{keep} bytes: {err}"
        );
    }
}

#[test]
fn a_missing_tensor_is_refused_by_name() {
    let err = load_edited("missing", |ts| ts.retain(|t| t.0 != KV_B)).unwrap_err();
    match err {
        ModelError::MissingTensor { file, tensor } => {
            assert_eq!(tensor, KV_B);
            assert!(file.ends_with(WEIGHTS_FILE));
        }
        other => panic!("{other}"),
    }
}

#[test]
fn a_tensor_of_the_wrong_shape_is_refused_with_both_shapes() {
    let err = load_edited("shape", |ts| {
        let t = ts.iter_mut().find(|t| t.0 == KV_B).unwrap();
        t.2 = vec![t.2[1], t.2[0]]; // transposed: same bytes, other shape
    })
    .unwrap_err();
    match err {
        ModelError::TensorShape {
            tensor,
            expected,
            got,
            ..
        } => {
            assert_eq!(tensor, KV_B);
            assert_eq!(expected, [4 * 256, 512]);
            assert_eq!(got, [512, 4 * 256]);
        }
        other => panic!("{other}"),
    }
}

#[test]
fn a_tensor_of_another_type_is_refused() {
    let err = load_edited("dtype", |ts| {
        ts.iter_mut().find(|t| t.0 == KV_B).unwrap().1 = Dtype::F16;
    })
    .unwrap_err();
    assert!(
        matches!(&err, ModelError::TensorDtype { tensor, dtype, .. } if tensor == KV_B && dtype == "F16"),
        "{err}"
    );
}

#[test]
fn a_nan_or_infinite_weight_is_refused_at_its_element() {
    for bits in [0x7fc0u16, 0x7f80, 0xff80] {
        let err = load_edited("nan", |ts| {
            let t = ts.iter_mut().find(|t| t.0 == KV_B).unwrap();
            t.3[2 * 1234..2 * 1235].copy_from_slice(&bits.to_le_bytes());
        })
        .unwrap_err();
        assert!(
            matches!(&err, ModelError::NonFiniteWeight { tensor, index: 1234, .. } if tensor == KV_B),
            "{err}"
        );
    }
}

#[test]
fn a_bad_or_missing_config_is_refused() {
    let dir = Scratch::new("config");
    Model::init(small_config(), 5)
        .unwrap()
        .save(&dir.0)
        .unwrap();
    let path = dir.0.join("config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        text.replace("\"kv_lora_rank\": 512", "\"kv_lora_rank\": 256"),
    )
    .unwrap();
    let err = Model::load(&dir.0).unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::Unsupported {
                field: "kv_lora_rank",
                ..
            }
        ),
        "{err}"
    );
    std::fs::write(&path, &text[..text.len() / 2]).unwrap();
    assert!(matches!(
        Model::load(&dir.0).unwrap_err(),
        ModelError::Json { .. }
    ));
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(
        Model::load(&dir.0).unwrap_err(),
        ModelError::Io { .. }
    ));
}

/// A checkpoint may carry tensors this model does not use (another model's head, buffers):
/// they are ignored.
#[test]
fn extra_tensors_are_ignored() {
    let model = load_edited("extra", |ts| {
        ts.push((
            "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
            Dtype::F32,
            vec![2],
            vec![0; 8],
        ));
    })
    .unwrap();
    assert_eq!(
        logits_of(&model),
        logits_of(&Model::init(small_config(), 5).unwrap())
    );
}
