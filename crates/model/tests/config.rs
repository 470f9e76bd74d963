//! `config.json`: the published DeepSeek-V2-Lite file parses into the preset, the presets
//! round-trip, and every value the model cannot run is refused by name.

// Test helpers panic on failure: that is how a test reports it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvroute_model::{ModelConfig, ModelError};

/// DeepSeek-V2-Lite's `config.json` as published on Hugging Face (`deepseek-ai/DeepSeek-V2-Lite`).
const V2_LITE: &str = r#"{
  "architectures": ["DeepseekV2ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "auto_map": {
    "AutoConfig": "configuration_deepseek.DeepseekV2Config",
    "AutoModel": "modeling_deepseek.DeepseekV2Model",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM"
  },
  "aux_loss_alpha": 0.001,
  "bos_token_id": 100000,
  "eos_token_id": 100001,
  "first_k_dense_replace": 1,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 10944,
  "kv_lora_rank": 512,
  "max_position_embeddings": 163840,
  "model_type": "deepseek_v2",
  "moe_intermediate_size": 1408,
  "moe_layer_freq": 1,
  "n_group": 1,
  "n_routed_experts": 64,
  "n_shared_experts": 2,
  "norm_topk_prob": false,
  "num_attention_heads": 16,
  "num_experts_per_tok": 6,
  "num_hidden_layers": 27,
  "num_key_value_heads": 16,
  "pretraining_tp": 1,
  "q_lora_rank": null,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "rms_norm_eps": 1e-06,
  "rope_scaling": {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "original_max_position_embeddings": 4096,
    "type": "yarn"
  },
  "rope_theta": 10000,
  "routed_scaling_factor": 1.0,
  "scoring_func": "softmax",
  "seq_aux": true,
  "tie_word_embeddings": false,
  "topk_group": 1,
  "topk_method": "greedy",
  "torch_dtype": "bfloat16",
  "transformers_version": "4.33.1",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 102400
}"#;

#[test]
fn the_published_v2_lite_config_parses_into_the_preset() {
    let parsed: ModelConfig = serde_json::from_str(V2_LITE).unwrap();
    assert_eq!(parsed, ModelConfig::deepseek_v2_lite());
    parsed.validate().unwrap();
}

#[test]
fn presets_round_trip_through_json() {
    for c in [ModelConfig::deepseek_v2_lite(), ModelConfig::tiny()] {
        let text = serde_json::to_string(&c).unwrap();
        assert_eq!(serde_json::from_str::<ModelConfig>(&text).unwrap(), c);
    }
}

/// The parameter count from the configuration's shapes matches the published 15.7B (which
/// checks every shape the checkpoint's tensors are expected to have, in sum).
#[test]
fn v2_lite_has_the_published_parameter_count() {
    let n = ModelConfig::deepseek_v2_lite().parameters().unwrap();
    assert!((15.65e9..15.75e9).contains(&(n as f64)), "{n}");
    let tiny = ModelConfig::tiny().parameters().unwrap();
    assert_eq!(tiny, 10_725_632);
}

#[test]
fn v2_lite_has_the_published_softmax_scale_and_layer_kinds() {
    let c = ModelConfig::deepseek_v2_lite();
    assert!((c.softmax_scale() - 0.1147).abs() < 5e-5);
    assert!(!c.is_moe_layer(0) && c.is_moe_layer(1) && c.is_moe_layer(26));
    let mut plain = c.clone();
    plain.rope_scaling = None;
    assert!((plain.softmax_scale() - 192f32.powf(-0.5)).abs() < 1e-7);
    let dims = c.dims();
    assert_eq!((dims.layers, dims.query_heads, dims.d_qk), (27, 16, 576));
}

/// Each change is refused, naming the field it breaks.
#[test]
fn configs_the_model_cannot_run_are_refused_by_field() {
    type Edit = fn(&mut ModelConfig);
    let cases: [(Edit, &str); 13] = [
        (|c| c.kv_lora_rank = 256, "kv_lora_rank"),
        (|c| c.qk_rope_head_dim = 32, "qk_rope_head_dim"),
        (|c| c.hidden_size = 0, "hidden_size"),
        (|c| c.num_attention_heads = 0, "num_attention_heads"),
        (|c| c.num_experts_per_tok = 9, "num_experts_per_tok"),
        (|c| c.num_experts_per_tok = 0, "num_experts_per_tok"),
        (|c| c.q_lora_rank = Some(0), "q_lora_rank"),
        (|c| c.rms_norm_eps = f64::NAN, "rms_norm_eps"),
        (
            |c| c.topk_method = "group_limited_greedy".into(),
            "topk_method",
        ),
        (|c| c.scoring_func = "sigmoid".into(), "scoring_func"),
        (
            |c| {
                if let Some(s) = &mut c.rope_scaling {
                    s.mscale = 1.0;
                }
            },
            "rope_scaling.mscale",
        ),
        (
            |c| {
                if let Some(s) = &mut c.rope_scaling {
                    s.kind = "linear".into();
                }
            },
            "rope_scaling.type",
        ),
        (|c| c.rope_theta = 0.5, "rope_theta / rope_scaling"),
    ];
    for (edit, field) in cases {
        let mut c = ModelConfig::tiny();
        edit(&mut c);
        match c.validate() {
            Err(ModelError::Config { field: f, .. } | ModelError::Unsupported { field: f, .. }) => {
                assert_eq!(f, field)
            }
            other => panic!("{field}: {other:?}"),
        }
    }
    ModelConfig::tiny().validate().unwrap();
}

#[test]
fn null_expert_counts_read_as_a_dense_model() {
    let text = V2_LITE
        .replace("\"n_routed_experts\": 64", "\"n_routed_experts\": null")
        .replace("\"num_experts_per_tok\": 6", "\"num_experts_per_tok\": 0");
    let c: ModelConfig = serde_json::from_str(&text).unwrap();
    assert_eq!(c.n_routed_experts, 0);
    assert!(!c.is_moe_layer(5));
    c.validate().unwrap();
}
