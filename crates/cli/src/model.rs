//! `kvroute model init`: a checkpoint of random weights, written under the tensor names and
//! in the files (`config.json`, `model.safetensors`) DeepSeek-V2-Lite's checkpoint uses, so
//! that `--model` reads it through the loader a real checkpoint goes through.

use std::fmt;

use anyhow::{Context, Result};
use kvroute_model::{CONFIG_FILE, Model, ModelConfig, WEIGHTS_FILE};
use serde::Serialize;

use crate::args::{ModelInitArgs, ModelPreset};

/// What `model init` wrote.
#[derive(Debug, Clone, Serialize)]
pub struct ModelInitReport {
    /// The directory.
    pub dir: String,
    /// The files written, with their sizes in bytes.
    pub files: Vec<(String, u64)>,
    /// Parameters.
    pub parameters: Option<u64>,
    /// Tensors.
    pub tensors: usize,
    /// The configuration.
    pub config: ModelConfig,
}

impl fmt::Display for ModelInitReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "wrote {} tensors ({:.1}M parameters) to {}:",
            self.tensors,
            self.parameters.unwrap_or(0) as f64 / 1e6,
            self.dir
        )?;
        for (name, bytes) in &self.files {
            writeln!(f, "  {name}: {bytes} bytes")?;
        }
        Ok(())
    }
}

/// `kvroute model init`.
pub(crate) fn init(args: &ModelInitArgs) -> Result<ModelInitReport> {
    let config = match args.preset {
        ModelPreset::Tiny => ModelConfig::tiny(),
        ModelPreset::DeepseekV2Lite => ModelConfig::deepseek_v2_lite(),
    };
    let model = Model::init(config, args.seed)?;
    model
        .save(&args.out)
        .with_context(|| format!("--out {}", args.out.display()))?;
    let files = [CONFIG_FILE, WEIGHTS_FILE]
        .iter()
        .map(|name| {
            let path = args.out.join(name);
            let bytes = std::fs::metadata(&path)
                .with_context(|| format!("{}", path.display()))?
                .len();
            Ok(((*name).to_owned(), bytes))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(ModelInitReport {
        dir: args.out.display().to_string(),
        files,
        parameters: model.config().parameters(),
        tensors: model.tensors().len(),
        config: model.config().clone(),
    })
}
