//! Prometheus metrics at `/metrics` (OpenMetrics text, which Prometheus and
//! its client libraries read), named after vLLM's so dashboards, KServe and
//! llm-d's inference gateway find them under a `slotstream:` prefix, each
//! generation metric labelled `model_name`: requests running and waiting,
//! time to first token, inter-token latency and end-to-end latency
//! histograms, prompt and generation tokens, finished requests by reason;
//! per loaded model, read at each scrape, the expert pool's hits, misses and
//! bytes read, the prefix cache's queries and hits (these restart from 0
//! when a model reloads, which Prometheus reads as a counter reset) and
//! `kv_cache_usage_perc`, the share of its token budget it holds; and per
//! endpoint, HTTP requests by status and their latency.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use super::lock;
use super::residency::Residency;
use crate::generate::FinishReason;

/// The `model_name` label of a generation metric.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabel {
    model_name: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FinishedLabels {
    model_name: String,
    finished_reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndpointLabel {
    endpoint: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HttpLabels {
    endpoint: String,
    status: String,
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// vLLM's buckets for each histogram, in seconds.
fn first_token_buckets() -> Histogram {
    Histogram::new([0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0])
}

fn inter_token_buckets() -> Histogram {
    Histogram::new([0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0])
}

fn request_buckets() -> Histogram {
    Histogram::new([0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0])
}

fn http_buckets() -> Histogram {
    Histogram::new([0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0])
}

/// The server's metrics.
pub struct Metrics {
    registry: Registry,
    running: Family<ModelLabel, Gauge>,
    waiting: Family<ModelLabel, Gauge>,
    first_token: Histograms<ModelLabel>,
    inter_token: Histograms<ModelLabel>,
    e2e: Histograms<ModelLabel>,
    prompt_tokens: Family<ModelLabel, Counter>,
    generation_tokens: Family<ModelLabel, Counter>,
    finished: Family<FinishedLabels, Counter>,
    http_requests: Family<HttpLabels, Counter>,
    http_seconds: Histograms<EndpointLabel>,
}

impl Metrics {
    /// Metrics over the models `residency` holds.
    pub(super) fn new(residency: Arc<Residency>) -> Metrics {
        let mut registry = Registry::default();
        let m = Metrics {
            running: Family::default(),
            waiting: Family::default(),
            first_token: Family::new_with_constructor(first_token_buckets as fn() -> Histogram),
            inter_token: Family::new_with_constructor(inter_token_buckets as fn() -> Histogram),
            e2e: Family::new_with_constructor(request_buckets as fn() -> Histogram),
            prompt_tokens: Family::default(),
            generation_tokens: Family::default(),
            finished: Family::default(),
            http_requests: Family::default(),
            http_seconds: Family::new_with_constructor(http_buckets as fn() -> Histogram),
            registry: Registry::default(),
        };
        registry.register("slotstream:num_requests_running", "Requests generating (up to --parallel at once)", m.running.clone());
        registry.register("slotstream:num_requests_waiting", "Requests waiting for their turn or for their model to load", m.waiting.clone());
        registry.register("slotstream:time_to_first_token_seconds", "From a request's arrival to its first token", m.first_token.clone());
        registry.register("slotstream:inter_token_latency_seconds", "Between consecutive generated tokens", m.inter_token.clone());
        registry.register("slotstream:e2e_request_latency_seconds", "From a request's arrival to its last token", m.e2e.clone());
        registry.register("slotstream:prompt_tokens", "Prompt tokens of finished requests", m.prompt_tokens.clone());
        registry.register("slotstream:generation_tokens", "Generated tokens of finished requests", m.generation_tokens.clone());
        registry.register("slotstream:request_success", "Finished requests, by why they finished (stop, length, abort)", m.finished.clone());
        registry.register("slotstream:http_requests", "HTTP requests answered, by endpoint and status", m.http_requests.clone());
        registry.register("slotstream:http_request_duration_seconds", "HTTP requests' time until their response ended", m.http_seconds.clone());
        registry.register_collector(Box::new(LoadedModels(residency)));
        Metrics { registry, ..m }
    }

    /// The exposition `/metrics` answers.
    pub(super) fn render(&self) -> Result<String, fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }

    fn model(name: &str) -> ModelLabel {
        ModelLabel { model_name: name.to_string() }
    }

    /// Counts a request waiting for `model` until the guard drops.
    pub(super) fn waiting(&self, model: &str) -> GaugeGuard {
        GaugeGuard::new(self.waiting.get_or_create_owned(&Metrics::model(model)))
    }

    /// Counts a generation of `model` running until the guard drops.
    pub(super) fn running(&self, model: &str) -> GaugeGuard {
        let label = Metrics::model(model);
        // The model's waiting gauge shows 0 from now on, not nothing (a
        // gateway reads the queue of every model it routes to).
        drop(self.waiting.get_or_create(&label));
        GaugeGuard::new(self.running.get_or_create_owned(&label))
    }

    pub(super) fn first_token(&self, model: &str, since_arrival: Duration) {
        self.first_token.get_or_create(&Metrics::model(model)).observe(since_arrival.as_secs_f64());
    }

    pub(super) fn inter_token(&self, model: &str, gap: Duration) {
        self.inter_token.get_or_create(&Metrics::model(model)).observe(gap.as_secs_f64());
    }

    /// A finished generation's latency, tokens and reason.
    pub(super) fn finished(&self, model: &str, total: Duration, prompt_tokens: usize, generated: usize, finish: FinishReason) {
        let label = Metrics::model(model);
        self.e2e.get_or_create(&label).observe(total.as_secs_f64());
        self.prompt_tokens.get_or_create(&label).inc_by(prompt_tokens as u64);
        self.generation_tokens.get_or_create(&label).inc_by(generated as u64);
        let reason = match finish {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "abort",
        };
        self.finished.get_or_create(&FinishedLabels { model_name: model.to_string(), finished_reason: reason.into() }).inc();
    }

    /// An HTTP request to `endpoint` (a route, or "other") answered `status`.
    pub(super) fn http(&self, endpoint: &str, status: u16, took: Duration) {
        self.http_requests.get_or_create(&HttpLabels { endpoint: endpoint.to_string(), status: status.to_string() }).inc();
        self.http_seconds.get_or_create(&EndpointLabel { endpoint: endpoint.to_string() }).observe(took.as_secs_f64());
    }
}

/// One unit of a gauge, given back when dropped.
pub(super) struct GaugeGuard(Gauge);

impl GaugeGuard {
    fn new(gauge: Gauge) -> GaugeGuard {
        gauge.inc();
        GaugeGuard(gauge)
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The loaded models' expert pool and prefix cache counters, read at each scrape.
struct LoadedModels(Arc<Residency>);

impl fmt::Debug for LoadedModels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LoadedModels")
    }
}

/// One counter family with a value per model.
fn per_model(encoder: &mut DescriptorEncoder, name: &str, help: &str, values: &[(String, u64)]) -> fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (model, value) in values {
        let labels = [("model_name", model.as_str())];
        ConstCounter::new(*value).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

impl Collector for LoadedModels {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let models = self.0.loaded();
        let (mut hits, mut misses, mut bytes, mut queries, mut cache_hits) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut usage, mut passes, mut rows) = (Vec::new(), Vec::new(), Vec::new());
        let (mut pass_hits, mut pass_misses, mut pass_bytes) = (Vec::new(), Vec::new(), Vec::new());
        for model in &models {
            let batch = model.engine.batch.counters();
            passes.push((model.name.clone(), batch.passes));
            rows.push((model.name.clone(), batch.rows));
            pass_hits.push((model.name.clone(), batch.expert_hits));
            pass_misses.push((model.name.clone(), batch.expert_misses));
            pass_bytes.push((model.name.clone(), batch.expert_bytes_read));
            let experts = lock(&model.expert_stats).total.clone();
            hits.push((model.name.clone(), experts.hits));
            misses.push((model.name.clone(), experts.misses));
            bytes.push((model.name.clone(), experts.bytes_read));
            if let Some(cache) = &model.prefix_cache {
                let stats = lock(cache).stats();
                queries.push((model.name.clone(), stats.hits + stats.misses));
                cache_hits.push((model.name.clone(), stats.hits));
                usage.push((model.name.clone(), stats.tokens as f64 / stats.token_budget.max(1) as f64));
            }
        }
        per_model(&mut encoder, "slotstream:expert_pool_hits", "Routed experts found in the slot pool", &hits)?;
        per_model(&mut encoder, "slotstream:expert_pool_misses", "Routed experts read from disk into the slot pool", &misses)?;
        per_model(&mut encoder, "slotstream:expert_bytes_read", "Bytes of experts read from disk", &bytes)?;
        per_model(&mut encoder, "slotstream:prefix_cache_queries", "Requests that looked up the prefix cache", &queries)?;
        per_model(&mut encoder, "slotstream:prefix_cache_hits", "Requests that reused a cached prompt prefix", &cache_hits)?;
        let help = "Decode passes of sequences generating together (--parallel above 1)";
        per_model(&mut encoder, "slotstream:decode_batch_passes", help, &passes)?;
        let help = "Sequence steps those passes computed (divided by the passes: the mean batch)";
        per_model(&mut encoder, "slotstream:decode_batch_rows", help, &rows)?;
        // Divided by the rows (each row is a generated token): per generated token.
        let help = "Routed (row, expert) pairs of those passes found in the slot pool";
        per_model(&mut encoder, "slotstream:decode_batch_expert_hits", help, &pass_hits)?;
        let help = "Experts those passes read from disk, each once for all the rows routed to it";
        per_model(&mut encoder, "slotstream:decode_batch_expert_misses", help, &pass_misses)?;
        let help = "Bytes of experts those passes read from disk (divided by decode_batch_rows: per generated token)";
        per_model(&mut encoder, "slotstream:decode_batch_expert_bytes_read", help, &pass_bytes)?;
        // The KV states kept between requests are the prefix cache's.
        let help = "Fraction of the prefix cache's token budget its kept KV states hold";
        let mut family = encoder.encode_descriptor("slotstream:kv_cache_usage_perc", help, None, MetricType::Gauge)?;
        for (model, fraction) in &usage {
            let labels = [("model_name", model.as_str())];
            ConstGauge::new(*fraction).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// What `/metrics` answers.
pub(super) async fn metrics(axum::extract::State(app): axum::extract::State<Arc<super::AppState>>) -> axum::response::Response {
    use axum::response::IntoResponse;
    match app.metrics.render() {
        Ok(text) => (
            axum::http::StatusCode::OK,
            [(axum::http::header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
            text,
        )
            .into_response(),
        Err(_) => axum::http::StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}
