//! The sweep's text report: every measured point beside its baseline and the model line.

use std::fmt;

use super::SweepReport;

/// Microseconds to one decimal, `-` for none.
fn us(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.1}")
    } else {
        "-".to_owned()
    }
}

/// A percentage to one decimal, `-` for none.
fn pct(m: Option<f64>) -> String {
    m.map_or("-".to_owned(), |m| format!("{m:.1}%"))
}

impl fmt::Display for SweepReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write_route(f)?;
        self.write_fits(f)?;
        self.write_fetch(f)?;
        self.write_concurrency(f)?;
        self.write_decode(f)?;
        for p in &self.plots {
            writeln!(f, "wrote {}", p.display())?;
        }
        writeln!(f, "raw samples: {}", self.json.display())
    }
}

impl SweepReport {
    /// The heading and the route table: every Mq's route beside its baseline and model.
    fn write_route(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "kvroute sweep over {} ({} progress), one holder process and this requester",
            self.provider, self.progress
        )?;
        writeln!(
            f,
            "\nroute, one layer of a {}-token chunk (medians, us; raw = the transport's write \
             round trip for the same bytes, this run; overhead = route - raw - kernel; of it, \
             holder = the holder's serve - kernel, codec = byte conversions on both sides, \
             memcpy = a cold copy of as many bytes as codec moves, this run, rest = overhead - \
             codec; zc = the zero-copy route right after it: query rows written into staging \
             by their producer, reply checked in place, zc-ovh = zc-route - raw - its kernel, \
             raw-w = raw with a pong the holder has just written, its writing taken out, \
             zc-wovh = zc-route - raw-w - its kernel, merge = merging its wire rows into f32, \
             not in zc-route):",
            self.route_ct
        )?;
        writeln!(
            f,
            "{:>6} {:>10} {:>9} {:>10} {:>9} {:>8} {:>8} {:>8} {:>8} {:>10} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8}",
            "Mq",
            "route",
            "raw",
            "kernel",
            "overhead",
            "holder",
            "codec",
            "memcpy",
            "rest",
            "route-krn",
            "model",
            "zc-route",
            "zc-ovh",
            "raw-w",
            "zc-wovh",
            "merge"
        )?;
        for p in &self.route {
            writeln!(
                f,
                "{:>6} {:>10} {:>9} {:>10} {:>9} {:>8} {:>8} {:>8} {:>8} {:>10} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8}",
                p.mq,
                us(p.route_us),
                us(p.raw_us),
                us(p.kernel_us),
                us(p.overhead_us),
                us(p.holder_overhead_us),
                us(p.codec_us),
                us(p.copy_floor_us),
                us(p.rest_us),
                us(p.transport_us),
                us(p.model_us),
                us(p.zero_copy_us),
                us(p.zero_copy_overhead_us),
                us(p.written_raw_us),
                us(p.zero_copy_written_overhead_us),
                us(p.merge_us)
            )?;
        }
        writeln!(
            f,
            "routed partials against the local kernel: max |o| difference {:.2e} (bf16 wire)",
            self.route_max_abs
        )
    }

    /// The cost model's fits to route - kernel and to the raw write.
    fn write_fits(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (name, fit) in [("route - kernel", &self.fit), ("raw write", &self.raw_fit)] {
            match fit {
                Some(fit) => writeln!(
                    f,
                    "fit T = T_probe + Mq (q + p) / BW to {name} (medians per Mq): T_probe {:.1} \
                     us, BW {:.2} GB/s; MAPE {} amortised (Mq >= 512, {} points), {:.1}% over \
                     all {}; over every repetition: {} amortised, {:.1}% over all {}",
                    fit.probe_us,
                    fit.bw_gbps,
                    pct(fit.mape.amortised_pct),
                    fit.mape.amortised_samples,
                    fit.mape.all_pct,
                    fit.mape.samples,
                    pct(fit.sample_mape.amortised_pct),
                    fit.sample_mape.all_pct,
                    fit.sample_mape.samples
                )?,
                None => writeln!(
                    f,
                    "fit to {name}: none (fewer than two distinct Mq, or times that do not \
                     grow with Mq: see the samples)"
                )?,
            }
        }
        Ok(())
    }

    /// The fetch table and its fit, if fetches were measured.
    fn write_fetch(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.fetch.is_empty() {
            writeln!(
                f,
                "\nfetch, every layer into pool pages, then the in-place splice (medians):"
            )?;
            writeln!(
                f,
                "{:>6} {:>12} {:>12} {:>10} {:>12} {:>8}",
                "ct", "bytes", "transfer us", "splice us", "total us", "GB/s"
            )?;
            for p in &self.fetch {
                writeln!(
                    f,
                    "{:>6} {:>12} {:>12} {:>10} {:>12} {:>8.2}",
                    p.ct,
                    p.bytes,
                    us(p.transfer_us),
                    us(p.splice_us),
                    us(p.total_us),
                    p.gbps
                )?;
            }
            if let Some((fixed, bw)) = self.fetch_fit {
                writeln!(f, "fit: {fixed:.1} us + bytes / {bw:.2} GB/s")?;
            }
        }
        Ok(())
    }

    /// The holder-capacity table, if measured.
    fn write_concurrency(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.concurrency.is_empty() {
            writeln!(
                f,
                "\nholder capacity: N requesters route {} rows each at once (medians):",
                self.concurrency.first().map_or(0, |p| p.rows / p.n.max(1))
            )?;
            writeln!(
                f,
                "{:>4} {:>6} {:>14} {:>10} {:>14} {:>14} {:>10}",
                "N",
                "rows",
                "kernel/call us",
                "rows/call",
                "kernel/round",
                "one call here",
                "route us"
            )?;
            for p in &self.concurrency {
                writeln!(
                    f,
                    "{:>4} {:>6} {:>14} {:>10.1} {:>14} {:>14} {:>10}",
                    p.n,
                    p.rows,
                    us(p.kernel_us_per_call),
                    p.rows_per_call,
                    us(p.kernel_us_per_round),
                    us(p.kernel_alone_us),
                    us(p.route_us)
                )?;
            }
        }
        Ok(())
    }

    /// The decode point: route, fetch and local there.
    fn write_decode(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = &self.decode;
        writeln!(
            f,
            "\ndecode point Mq = {}, ct = {}: route {} us, fetch {} us (transfer + splice), \
             local {} us (cost model ct x L x c, c = 1 us: no weights here, not measured); \
             route moves {:.0}% fewer wire bytes than one layer of the chunk",
            d.mq,
            d.ct,
            d.route_us.map_or("-".to_owned(), us),
            d.fetch_us.map_or("-".to_owned(), us),
            us(d.local_model_us),
            d.route_bytes_saved * 100.0
        )
    }
}
