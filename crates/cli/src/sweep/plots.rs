//! The PNGs, drawn with plotters' bitmap backend and a TrueType font from the system.

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{Result, anyhow, bail};
use kvroute_costmodel::crossover::byte_crossover_rows;
use kvroute_costmodel::model_preset;

use super::SweepReport;

/// Where the font may be (Debian's fonts-dejavu-core first, which `cargo xtask deps`
/// installs); `KVROUTE_FONT` overrides.
const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
];

pub(crate) fn font() -> Result<()> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let candidates: Vec<PathBuf> = std::env::var_os("KVROUTE_FONT")
                .map(PathBuf::from)
                .into_iter()
                .chain(FONTS.iter().map(PathBuf::from))
                .collect();
            let path = candidates.iter().find(|p| p.is_file()).ok_or_else(|| {
                "the plots need a TrueType font: install fonts-dejavu-core \
                 (`cargo xtask deps` does) or set KVROUTE_FONT"
                    .to_owned()
            })?;
            let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
            // Registered for the life of the process, once.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| format!("{} is not a usable font", path.display()))
        })
        .clone()
        .map_err(|e| anyhow!(e))
}

/// A plotted series: legend, colour, and the value it draws from each sample.
type Series<T> = (&'static str, RGBColor, fn(&T) -> f64);

pub(crate) fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing: {e:?}")
}

pub(super) fn all(r: &SweepReport, dir: &Path) -> Result<Vec<PathBuf>> {
    font()?;
    let mut out = Vec::new();
    if !r.route.is_empty() {
        out.push(route(r, &dir.join("route.png"))?);
    }
    if !r.fetch.is_empty() {
        out.push(fetch(r, &dir.join("fetch.png"))?);
    }
    out.push(winner(r, &dir.join("winner.png"))?);
    if !r.concurrency.is_empty() {
        out.push(capacity(r, &dir.join("capacity.png"))?);
    }
    Ok(out)
}

/// A log-log chart on a white `root`: the caption, ((range, description)) of each axis,
/// and whether to draw the grid.
pub(crate) fn log_chart<'a, 'b>(
    root: &'a DrawingArea<BitMapBackend<'b>, Shift>,
    caption: impl AsRef<str>,
    ((x0, x1), x_desc): ((f64, f64), &str),
    ((y0, y1), y_desc): ((f64, f64), &str),
    grid: bool,
) -> Result<Chart<'a, 'b>> {
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(root)
        .caption(caption.as_ref(), ("sans-serif", 24))
        .margin(18)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())
        .map_err(err)?;
    let mut mesh = chart.configure_mesh();
    if !grid {
        mesh.disable_mesh();
    }
    mesh.x_desc(x_desc)
        .y_desc(y_desc)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(err)?;
    Ok(chart)
}

/// Draws the legend at `at` and writes the PNG.
pub(crate) fn finish<'a, 'b: 'a>(
    chart: &mut Chart<'a, 'b>,
    root: &DrawingArea<BitMapBackend<'b>, Shift>,
    at: SeriesLabelPosition,
) -> Result<()> {
    chart
        .configure_series_labels()
        .position(at)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// The charts here: log-scaled f64 on both axes, over a bitmap of lifetime `'b`.
type Chart<'a, 'b> = ChartContext<'a, BitMapBackend<'b>, Cartesian2d<LogCoord<f64>, LogCoord<f64>>>;

pub(crate) fn range(values: impl Iterator<Item = f64>) -> Result<(f64, f64)> {
    let (lo, hi) = values
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold((f64::INFINITY, 0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !lo.is_finite() {
        bail!("nothing to plot");
    }
    Ok((lo / 1.6, hi * 1.6))
}

pub(crate) fn legend(color: RGBColor) -> impl Fn((i32, i32)) -> PathElement<(i32, i32)> {
    move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
}

/// Figures 2b / 6b: route round trip against Mq, the fitted model, the raw write round
/// trip, fetch (measured) and local (model) at this ct as reference lines.
fn route(r: &SweepReport, path: &Path) -> Result<PathBuf> {
    let fetch = r.decode.fetch_us;
    let local = r.decode.local_model_us;
    let (x0, x1) = range(r.route.iter().map(|p| f64::from(p.mq)))?;
    let (y0, y1) = range(
        r.route_samples
            .iter()
            .flat_map(|s| [s.route_us, s.raw_us, s.route_us - s.kernel_us])
            .chain(fetch)
            .chain([local]),
    )?;
    let root = BitMapBackend::new(path, (1100, 720)).into_drawing_area();
    let mut chart = log_chart(
        &root,
        format!(
            "route round trip vs Mq ({}, ct = {}, one layer)",
            r.provider, r.route_ct
        ),
        ((x0, x1), "Mq (query rows)"),
        ((y0, y1), "microseconds"),
        true,
    )?;
    let series: [Series<super::RouteSample>; 3] = [
        (
            "route (measured, kernel included)",
            RGBColor(0, 128, 0),
            |s| s.route_us,
        ),
        (
            "route - holder kernel (measured)",
            RGBColor(0, 90, 200),
            |s| s.route_us - s.kernel_us,
        ),
        (
            "raw write round trip, same bytes",
            RGBColor(120, 120, 120),
            |s| s.raw_us,
        ),
    ];
    for (name, color, value) in series {
        chart
            .draw_series(
                r.route_samples
                    .iter()
                    .map(|s| Circle::new((f64::from(s.mq), value(s)), 3, color.filled())),
            )
            .map_err(err)?
            .label(name)
            .legend(legend(color));
    }
    if let Some(fit) = &r.fit {
        let line: Vec<(f64, f64)> = (0..=60)
            .map(|i| {
                let mq = x0 * (x1 / x0).powf(f64::from(i) / 60.0);
                (mq, fit.model_us(mq))
            })
            .collect();
        let color = RGBColor(0, 90, 200);
        chart
            .draw_series(LineSeries::new(line, color.stroke_width(2)))
            .map_err(err)?
            .label(format!(
                "model T_probe + Mq (q+p)/BW: {:.0} us, {:.2} GB/s (MAPE amortised {})",
                fit.probe_us,
                fit.bw_gbps,
                fit.mape
                    .amortised_pct
                    .map_or("-".to_owned(), |m| format!("{m:.1}%"))
            ))
            .legend(legend(color));
    }
    let mut flat = |y: f64, name: String, color: RGBColor| -> Result<()> {
        chart
            .draw_series(DashedLineSeries::new(
                vec![(x0, y), (x1, y)],
                8,
                5,
                color.stroke_width(2),
            ))
            .map_err(err)?
            .label(name)
            .legend(legend(color));
        Ok(())
    };
    if let Some(fetch) = fetch {
        flat(
            fetch,
            format!("fetch at ct = {} (measured: pull + splice)", r.route_ct),
            RGBColor(200, 0, 0),
        )?;
    }
    flat(
        local,
        format!(
            "local at ct = {} (model: ct x L x 1 us, no weights)",
            r.route_ct
        ),
        RGBColor(128, 0, 128),
    )?;
    finish(&mut chart, &root, SeriesLabelPosition::UpperLeft)?;
    Ok(path.to_path_buf())
}

/// Fetch time against ct: transfer, splice, total, the fitted transfer line.
fn fetch(r: &SweepReport, path: &Path) -> Result<PathBuf> {
    let (x0, x1) = range(r.fetch.iter().map(|p| f64::from(p.ct)))?;
    let (y0, y1) = range(
        r.fetch_samples
            .iter()
            .flat_map(|s| [s.transfer_us, s.splice_us, s.transfer_us + s.splice_us]),
    )?;
    let root = BitMapBackend::new(path, (1100, 720)).into_drawing_area();
    let mut chart = log_chart(
        &root,
        format!(
            "fetch vs ct ({}, 27 layers, pool pages + splice)",
            r.provider
        ),
        ((x0, x1), "ct (chunk tokens)"),
        ((y0, y1), "microseconds"),
        true,
    )?;
    let series: [Series<super::FetchSample>; 3] = [
        ("transfer (measured)", RGBColor(200, 0, 0), |s| {
            s.transfer_us
        }),
        ("splice (measured)", RGBColor(230, 140, 0), |s| s.splice_us),
        ("fetch total", RGBColor(90, 0, 0), |s| {
            s.transfer_us + s.splice_us
        }),
    ];
    for (name, color, value) in series {
        chart
            .draw_series(
                r.fetch_samples
                    .iter()
                    .map(|s| Circle::new((f64::from(s.ct), value(s)), 3, color.filled())),
            )
            .map_err(err)?
            .label(name)
            .legend(legend(color));
    }
    if let Some((fixed, bw)) = r.fetch_fit {
        let bytes_per_token = r
            .fetch
            .first()
            .map_or(0.0, |p| p.bytes as f64 / f64::from(p.ct));
        let line: Vec<(f64, f64)> = (0..=60)
            .map(|i| {
                let ct = x0 * (x1 / x0).powf(f64::from(i) / 60.0);
                (ct, fixed + ct * bytes_per_token / (bw * 1e3))
            })
            .collect();
        let color = RGBColor(200, 0, 0);
        chart
            .draw_series(LineSeries::new(line, color.stroke_width(2)))
            .map_err(err)?
            .label(format!("fit: {fixed:.0} us + bytes / {bw:.2} GB/s"))
            .legend(legend(color));
    }
    if let Some(route) = r.decode.route_us {
        let color = RGBColor(0, 128, 0);
        chart
            .draw_series(DashedLineSeries::new(
                vec![(x0, route), (x1, route)],
                8,
                5,
                color.stroke_width(2),
            ))
            .map_err(err)?
            .label(format!("route at Mq = {} (measured)", r.decode.mq))
            .legend(legend(color));
    }
    finish(&mut chart, &root, SeriesLabelPosition::UpperLeft)?;
    Ok(path.to_path_buf())
}

/// Figure 3b: route vs fetch on wire bytes over (Mq, ct), DeepSeek-V2-Lite bf16, with the
/// break-even line `Mq = ct b_KV / (q + p)` and the decode point.
fn winner(r: &SweepReport, path: &Path) -> Result<PathBuf> {
    let dims = model_preset("deepseek-v2-lite")?.dims;
    let (x0, x1) = (1.0f64, 8192.0f64);
    let (y0, y1) = (64.0f64, 65536.0f64);
    let root = BitMapBackend::new(path, (1000, 760)).into_drawing_area();
    let mut chart = log_chart(
        &root,
        "wire-byte winner: route (green) vs fetch of one layer (red)",
        ((x0, x1), "Mq (query rows)"),
        ((y0, y1), "ct (chunk tokens)"),
        false,
    )?;
    let (nx, ny) = (52, 40);
    let mut cells = Vec::new();
    for i in 0..nx {
        for j in 0..ny {
            let xa = x0 * (x1 / x0).powf(f64::from(i) / f64::from(nx));
            let xb = x0 * (x1 / x0).powf(f64::from(i + 1) / f64::from(nx));
            let ya = y0 * (y1 / y0).powf(f64::from(j) / f64::from(ny));
            let yb = y0 * (y1 / y0).powf(f64::from(j + 1) / f64::from(ny));
            let (mq, ct) = ((xa * xb).sqrt(), (ya * yb).sqrt());
            let crossover = byte_crossover_rows(&dims, ct.round() as u32)?;
            let saved = 1.0 - mq / crossover;
            // Saturation shows the margin: pale near the line, deep far from it.
            let t = saved.abs().min(1.0);
            let shade = |full: u8| (255.0 - (255.0 - f64::from(full)) * (0.25 + 0.75 * t)) as u8;
            let color = if saved > 0.0 {
                RGBColor(shade(40), shade(160), shade(40))
            } else {
                RGBColor(shade(200), shade(40), shade(40))
            };
            cells.push(Rectangle::new([(xa, ya), (xb, yb)], color.filled()));
        }
    }
    chart.draw_series(cells).map_err(err)?;
    let line: Vec<(f64, f64)> = (0..=60)
        .map(|i| {
            let ct = y0 * (y1 / y0).powf(f64::from(i) / 60.0);
            let mq = byte_crossover_rows(&dims, ct.round() as u32).unwrap_or(f64::NAN);
            (mq, ct)
        })
        .filter(|(mq, _)| *mq >= x0 && *mq <= x1)
        .collect();
    chart
        .draw_series(DashedLineSeries::new(line, 8, 5, BLACK.stroke_width(2)))
        .map_err(err)?
        .label("break-even Mq = ct b_KV / (q + p)")
        .legend(legend(BLACK));
    let (mq, ct) = (f64::from(r.decode.mq), f64::from(r.decode.ct));
    chart
        .draw_series([Circle::new((mq, ct), 7, BLACK.filled())])
        .map_err(err)?
        .label(format!(
            "decode point Mq = {}, ct = {}: route moves {:.0}% fewer bytes",
            r.decode.mq,
            r.decode.ct,
            r.decode.route_bytes_saved * 100.0
        ))
        .legend(|(x, y)| Circle::new((x + 10, y), 5, BLACK.filled()));
    finish(&mut chart, &root, SeriesLabelPosition::LowerRight)?;
    Ok(path.to_path_buf())
}

/// Paper 000 figure 5a's question: holder kernel time against concurrent requesters.
fn capacity(r: &SweepReport, path: &Path) -> Result<PathBuf> {
    let (x0, x1) = range(r.concurrency.iter().map(|p| f64::from(p.n)))?;
    let (y0, y1) = range(r.concurrency.iter().flat_map(|p| {
        [
            p.kernel_us_per_call,
            p.kernel_alone_us,
            p.route_us,
            p.kernel_us_per_round,
        ]
    }))?;
    let root = BitMapBackend::new(path, (1100, 720)).into_drawing_area();
    let mut chart = log_chart(
        &root,
        format!(
            "holder partial attention vs concurrent requesters ({}, ct = {})",
            r.provider, r.route_ct
        ),
        ((x0, x1), "N concurrent requesters"),
        ((y0, y1), "microseconds"),
        true,
    )?;
    let series: [Series<super::ConcurrencyPoint>; 4] = [
        ("holder kernel per call", RGBColor(0, 128, 0), |p| {
            p.kernel_us_per_call
        }),
        ("holder kernel per round", RGBColor(0, 90, 200), |p| {
            p.kernel_us_per_round
        }),
        (
            "one in-process call over all N requests' rows",
            RGBColor(120, 120, 120),
            |p| p.kernel_alone_us,
        ),
        ("requester round trip (median)", RGBColor(200, 0, 0), |p| {
            p.route_us
        }),
    ];
    for (name, color, value) in series {
        let pts: Vec<(f64, f64)> = r
            .concurrency
            .iter()
            .map(|p| (f64::from(p.n), value(p)))
            .collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(err)?
            .label(name)
            .legend(legend(color));
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 4, color.filled())))
            .map_err(err)?;
    }
    finish(&mut chart, &root, SeriesLabelPosition::UpperLeft)?;
    Ok(path.to_path_buf())
}
