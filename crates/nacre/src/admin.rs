//! The admin front ends: the HTTP/JSON API served by masters (`/api/v1/…`) and the CLI commands
//! `nacre cluster|node|func|vol|partition|tenant`. Both call `nacre_master::admin::Admin` and show the
//! same answers; the CLI prints tables, or the API's JSON with `--json`.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get};
use axum::{Json, Router};
use clap::{Args, Subcommand};
use comfy_table::Table;
use nacre_client::MasterClient;
use nacre_master::MasterError;
use nacre_master::admin::{Admin, CreateVolume, PartitionInfo, VolumeInfo};
use nacre_master::map::{Function, MapError, Role};
use nacre_msgr::{Messenger, MsgrConfig, TcpTransport};
use serde::{Deserialize, Serialize};

use crate::bench::report::parse_size;

// ---------------------------------------------------------------------------------------------
// HTTP

/// `/api/v1/…` on a master. Any master answers: requests go to the leader through the messenger.
pub fn http_router(admin: Admin) -> Router {
    Router::new()
        .route("/api/v1/status", get(status))
        .route("/api/v1/nodes", get(nodes))
        .route("/api/v1/funcs", get(funcs))
        .route("/api/v1/volumes", get(volumes).post(create_volume))
        .route("/api/v1/volumes/{name}", get(volume).delete(delete_volume))
        .route(
            "/api/v1/volumes/{name}/gc",
            axum::routing::post(sweep_volume),
        )
        .route("/api/v1/partitions", get(partitions))
        .route("/api/v1/tenants", get(tenants).post(create_tenant))
        .route("/api/v1/tenants/{name}", delete(delete_tenant))
        .with_state(admin)
}

/// An error answer: `{"error": "..."}` with a status code that says whose fault it is.
struct ApiError(MasterError);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let code = match &self.0 {
            MasterError::Map(e) => match e {
                MapError::InvalidName(_) | MapError::InvalidTenant(_) | MapError::Invalid(_) => {
                    StatusCode::BAD_REQUEST
                }
                MapError::NoSuchVolume(_)
                | MapError::NoSuchTenant(_)
                | MapError::UnknownNode(_)
                | MapError::UnknownPartition(_) => StatusCode::NOT_FOUND,
                MapError::VolumeExists(_)
                | MapError::TenantExists(_)
                | MapError::TenantInUse(..)
                | MapError::Placement { .. } => StatusCode::CONFLICT,
            },
            MasterError::NotLeader { .. } | MasterError::Unavailable(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
        };
        (
            code,
            Json(serde_json::json!({ "error": self.0.to_string() })),
        )
            .into_response()
    }
}

type ApiResult<T> = Result<Json<T>, ApiError>;

fn api<T>(r: Result<T, MasterError>) -> ApiResult<T> {
    r.map(Json).map_err(ApiError)
}

async fn status(State(a): State<Admin>) -> impl IntoResponse {
    api(a.status().await)
}

async fn nodes(State(a): State<Admin>) -> impl IntoResponse {
    api(a.nodes().await)
}

async fn funcs(State(a): State<Admin>) -> impl IntoResponse {
    api(a.funcs().await)
}

async fn volumes(State(a): State<Admin>) -> impl IntoResponse {
    api(a.volumes().await)
}

async fn volume(State(a): State<Admin>, UrlPath(name): UrlPath<String>) -> impl IntoResponse {
    api(a.volume(&name).await)
}

/// `POST /api/v1/volumes/{name}/gc?grace_secs=N` (default 3600): `nacre vol gc`.
#[derive(Debug, Deserialize)]
struct SweepParams {
    grace_secs: Option<f64>,
}

async fn sweep_volume(
    State(a): State<Admin>,
    UrlPath(name): UrlPath<String>,
    Query(p): Query<SweepParams>,
) -> impl IntoResponse {
    let grace = Duration::from_secs_f64(p.grace_secs.unwrap_or(3600.0).clamp(0.0, 1e9));
    api(a.sweep(&name, grace).await)
}

async fn create_volume(State(a): State<Admin>, Json(req): Json<CreateVolume>) -> Response {
    match a.create_volume(&req).await {
        Ok(v) => (StatusCode::CREATED, Json(v)).into_response(),
        Err(e) => ApiError(e).into_response(),
    }
}

async fn delete_volume(State(a): State<Admin>, UrlPath(name): UrlPath<String>) -> Response {
    match a.delete_volume(&name).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => ApiError(e).into_response(),
    }
}

#[derive(Debug, Deserialize)]
struct PartitionQuery {
    volume: Option<String>,
}

async fn partitions(State(a): State<Admin>, Query(q): Query<PartitionQuery>) -> impl IntoResponse {
    api(a.partitions(q.volume.as_deref()).await)
}

async fn tenants(State(a): State<Admin>) -> impl IntoResponse {
    api(a.tenants().await)
}

#[derive(Debug, Deserialize)]
struct CreateTenantRequest {
    name: String,
}

async fn create_tenant(State(a): State<Admin>, Json(req): Json<CreateTenantRequest>) -> Response {
    match a.create_tenant(&req.name).await {
        Ok(t) => (StatusCode::CREATED, Json(t)).into_response(),
        Err(e) => ApiError(e).into_response(),
    }
}

async fn delete_tenant(State(a): State<Admin>, UrlPath(name): UrlPath<String>) -> Response {
    match a.delete_tenant(&name).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => ApiError(e).into_response(),
    }
}

// ---------------------------------------------------------------------------------------------
// CLI

/// Options every admin command takes.
#[derive(Debug, Args)]
pub struct Common {
    /// Master addresses (`host:port`, comma-separated). Defaults to the masters of the `nacre up`
    /// cluster in ./.nacre.
    #[arg(long, global = true, env = "NACRE_MASTERS", value_delimiter = ',')]
    master: Vec<String>,
    /// Print JSON (the HTTP API's format) instead of a table.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Debug, Args)]
pub struct ClusterArgs {
    #[command(flatten)]
    common: Common,
    #[command(subcommand)]
    cmd: ClusterCmd,
}

#[derive(Debug, Subcommand)]
enum ClusterCmd {
    /// Masters, node and partition counts, and work the leader has not finished.
    Status,
}

#[derive(Debug, Args)]
pub struct NodeArgs {
    #[command(flatten)]
    common: Common,
    #[command(subcommand)]
    cmd: NodeCmd,
}

#[derive(Debug, Subcommand)]
enum NodeCmd {
    /// Every registered meta, data and func node.
    List,
    /// One process's messenger, asked directly: its workers (connections, traffic, busy time),
    /// its live connections and how often the balancer moved them.
    Info {
        /// The node's address (`host:port`, as `nacre node list` shows it).
        addr: String,
    },
}

#[derive(Debug, Args)]
pub struct FuncArgs {
    #[command(flatten)]
    common: Common,
    #[command(subcommand)]
    cmd: FuncCmd,
}

#[derive(Debug, Subcommand)]
enum FuncCmd {
    /// Every registered function server: address, status, functions, load and calls/s.
    #[command(visible_alias = "list")]
    Ls,
}

#[derive(Debug, Args)]
pub struct VolArgs {
    #[command(flatten)]
    common: Common,
    #[command(subcommand)]
    cmd: VolCmd,
}

#[derive(Debug, Subcommand)]
enum VolCmd {
    /// Create a volume: its meta and data partitions are placed and created on the nodes.
    Create(VolCreateArgs),
    /// All volumes.
    List,
    /// One volume and its partitions.
    Info { name: String },
    /// Delete a volume; nodes drop its partitions.
    Delete { name: String },
    /// Sweep the volume's data partitions for leaked extents now: delete the normal extents no
    /// meta partition references that had no write for `--grace-secs`. A grace under 1800 s is
    /// safe only while no client writes to the volume.
    Gc {
        name: String,
        #[arg(long, default_value_t = 3600.0)]
        grace_secs: f64,
    },
}

#[derive(Debug, Args)]
struct VolCreateArgs {
    /// Volume name: 1-63 characters from a-z, 0-9, '-', starting with a letter.
    name: String,
    /// Owning tenant.
    #[arg(long, default_value = "default")]
    owner: String,
    #[arg(long, default_value_t = 3)]
    replicas: u8,
    /// Quota in bytes (units k, m, g, t); 0 is unlimited.
    #[arg(long, value_parser = parse_size, default_value = "0")]
    capacity: usize,
    #[arg(long, default_value_t = 3)]
    meta_partitions: u32,
    #[arg(long, default_value_t = 10)]
    data_partitions: u32,
    /// Inodes per initial meta partition (the last is open-ended).
    #[arg(long, default_value_t = 1 << 24)]
    inode_step: u64,
    /// Compress file data in 64 KiB blocks: `zstd` (level 1), `zstd:LEVEL` or `lz4`.
    #[arg(long)]
    compress: Option<String>,
    /// Where clients run the compression: `inline` (in the client) or `service` (on the
    /// function servers).
    #[arg(long, default_value = "inline")]
    func_at: nacre_api::master::FuncAt,
    /// With `--func-at service`: fail a write when no function server is left, instead of
    /// compressing in the client.
    #[arg(long)]
    no_fallback: bool,
    /// Erasure-code file data as K data and M parity shards (e.g. `4+2`) on K+M data nodes
    /// per partition, instead of replicating it.
    #[arg(long, value_name = "K+M")]
    ec: Option<String>,
    /// Seconds to wait for every replica to be created on its node.
    #[arg(long, default_value_t = 10.0)]
    wait: f64,
}

#[derive(Debug, Args)]
pub struct PartitionArgs {
    #[command(flatten)]
    common: Common,
    #[command(subcommand)]
    cmd: PartitionCmd,
}

#[derive(Debug, Subcommand)]
enum PartitionCmd {
    /// Meta and data partitions, with replicas, leaders and status.
    List {
        /// Only this volume's partitions.
        #[arg(long)]
        volume: Option<String>,
    },
}

#[derive(Debug, Args)]
pub struct TenantArgs {
    #[command(flatten)]
    common: Common,
    #[command(subcommand)]
    cmd: TenantCmd,
}

#[derive(Debug, Subcommand)]
enum TenantCmd {
    /// Create a tenant; prints its access key and secret (shown only once).
    Create {
        name: String,
    },
    List,
    /// Delete a tenant that owns no volume.
    Delete {
        name: String,
    },
}

/// What a top-level admin command is.
#[derive(Debug)]
pub enum AdminCmd {
    Cluster(ClusterArgs),
    Node(NodeArgs),
    Func(FuncArgs),
    Vol(VolArgs),
    Partition(PartitionArgs),
    Tenant(TenantArgs),
}

/// Runs an admin command to completion.
pub fn run(cmd: AdminCmd) -> anyhow::Result<()> {
    let common = match &cmd {
        AdminCmd::Cluster(a) => &a.common,
        AdminCmd::Node(a) => &a.common,
        AdminCmd::Func(a) => &a.common,
        AdminCmd::Vol(a) => &a.common,
        AdminCmd::Partition(a) => &a.common,
        AdminCmd::Tenant(a) => &a.common,
    };
    let masters = resolve_masters(&common.master)?;
    let json = common.json;
    crate::runtime()?.block_on(async move {
        let cfg = MsgrConfig {
            workers: 1,
            connect_timeout: Duration::from_secs(2),
            ..MsgrConfig::default()
        };
        let msgr = Messenger::new("cli", cfg, Arc::new(TcpTransport))?;
        let admin = Admin::new(MasterClient::new(msgr.client(), masters));
        let r = match cmd {
            AdminCmd::Node(NodeArgs {
                cmd: NodeCmd::Info { addr },
                ..
            }) => node_info(&msgr.client(), &addr, json).await,
            cmd => dispatch(&admin, cmd, json).await,
        };
        let m = msgr.clone();
        tokio::task::spawn_blocking(move || m.shutdown()).await?;
        r
    })
}

/// `--master`/`NACRE_MASTERS`, else the masters `nacre up` recorded in ./.nacre/up.json.
pub(crate) fn resolve_masters(given: &[String]) -> anyhow::Result<Vec<String>> {
    resolve_masters_in(given, Path::new(".nacre"))
}

/// `--master`/`NACRE_MASTERS`, else the masters `nacre up` recorded in `up_dir`/up.json.
pub(crate) fn resolve_masters_in(given: &[String], up_dir: &Path) -> anyhow::Result<Vec<String>> {
    let given: Vec<String> = given.iter().filter(|m| !m.is_empty()).cloned().collect();
    if !given.is_empty() {
        return Ok(given);
    }
    let path = &up_dir.join("up.json");
    let text = std::fs::read_to_string(path).map_err(|_| {
        anyhow::anyhow!(
            "no master address: pass --master HOST:PORT[,…], set NACRE_MASTERS, or run this \
             where `nacre up` runs (it records its masters in {})",
            path.display()
        )
    })?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("cannot parse {}", path.display()))?;
    let masters: Vec<String> = v["masters"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|m| m.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    anyhow::ensure!(!masters.is_empty(), "{} lists no masters", path.display());
    Ok(masters)
}

/// `nacre node info ADDR`.
async fn node_info(client: &nacre_msgr::Client, addr: &str, json: bool) -> anyhow::Result<()> {
    use nacre_proto::msg::sys::{MsgrInfo, MsgrInfoRequest};
    let (info, _) = client
        .call::<MsgrInfo>(addr, &MsgrInfoRequest {}, nacre_msgr::Payload::none())
        .await
        .with_context(|| format!("cannot ask {addr} for its messenger's state"))?;
    if json {
        return print_json(&info);
    }
    println!(
        "{}: {} workers, balancer {}, dual workers {}, {} connection moves",
        info.name,
        info.workers.len(),
        info.balance,
        if info.dual { "on" } else { "off" },
        info.migrations
    );
    let secs = |ms: u64| format!("{:.1}s", ms as f64 / 1000.0);
    let mut t = table(&["worker", "connections", "traffic", "frames", "busy"]);
    for w in &info.workers {
        t.add_row(vec![
            w.index.to_string(),
            w.connections.to_string(),
            bytes(w.bytes),
            w.frames.to_string(),
            secs(w.busy_ms),
        ]);
    }
    println!("{t}");
    let mut t = table(&[
        "conn", "side", "peer", "worker", "busy", "traffic", "frames", "moves",
    ]);
    for c in &info.connections {
        t.add_row(vec![
            c.id.to_string(),
            c.side.clone(),
            c.peer.clone(),
            c.worker.to_string(),
            secs(c.busy_ms),
            bytes(c.bytes),
            c.frames.to_string(),
            c.migrations.to_string(),
        ]);
    }
    println!("{t}");
    Ok(())
}

fn print_json<T: Serialize>(v: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(comfy_table::presets::UTF8_FULL_CONDENSED);
    t.set_header(header.iter().copied());
    t
}

/// Bytes for humans: `0 B`, `512 B`, `1.5 KiB`, `23.5 GiB`.
fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// A function server's offer: `all`, or the names.
fn functions(fs: &[Function]) -> String {
    if Function::ALL.iter().all(|f| fs.contains(f)) {
        return "all".into();
    }
    ids(fs)
}

fn ids<T: std::fmt::Display>(v: &[T]) -> String {
    v.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

async fn dispatch(admin: &Admin, cmd: AdminCmd, json: bool) -> anyhow::Result<()> {
    match cmd {
        AdminCmd::Cluster(ClusterArgs {
            cmd: ClusterCmd::Status,
            ..
        }) => {
            let s = admin.status().await?;
            if json {
                return print_json(&s);
            }
            let mut t = table(&["master", "address", "role"]);
            for m in &s.masters {
                t.add_row(vec![
                    m.id.to_string(),
                    m.addr.clone(),
                    if m.leader { "leader" } else { "follower" }.to_string(),
                ]);
            }
            println!("{t}");
            println!(
                "epoch {}  nodes {} up, {} down  volumes {}  meta partitions {}  data partitions {} ({} writable)",
                s.epoch,
                s.nodes_up,
                s.nodes_down,
                s.volumes,
                s.meta_partitions,
                s.data_partitions,
                s.data_partitions_rw
            );
            for p in &s.pending {
                println!(
                    "pending: partition {} on {} ({}), {} attempts{}",
                    p.partition,
                    p.node,
                    p.addr,
                    p.attempts,
                    if p.last_error.is_empty() {
                        String::new()
                    } else {
                        format!(", last error: {}", p.last_error)
                    }
                );
            }
            for e in &s.duty_errors {
                println!("duty failed: {e}");
            }
            Ok(())
        }
        AdminCmd::Node(NodeArgs {
            cmd: NodeCmd::Info { addr },
            ..
        }) => anyhow::bail!("node info {addr} is answered by the node itself, not a master"),
        AdminCmd::Node(NodeArgs {
            cmd: NodeCmd::List, ..
        }) => {
            let nodes = admin.nodes().await?;
            if json {
                return print_json(&nodes);
            }
            let mut t = table(&[
                "id",
                "address",
                "role",
                "zone",
                "status",
                "used",
                "capacity",
                "partitions",
                "heartbeat",
            ]);
            for n in &nodes {
                // A function server's capacity is calls, not bytes (`nacre func ls`).
                let sized = |b: u64| {
                    if n.role == Role::Func {
                        "-".to_string()
                    } else {
                        bytes(b)
                    }
                };
                t.add_row(vec![
                    n.id.to_string(),
                    n.addr.clone(),
                    format!("{:?}", n.role).to_lowercase(),
                    n.zone.clone(),
                    format!("{:?}", n.status).to_lowercase(),
                    sized(n.used),
                    sized(n.capacity),
                    n.partitions.to_string(),
                    format!("{:.1}s ago", n.last_heartbeat_ms_ago as f64 / 1000.0),
                ]);
            }
            println!("{t}");
            Ok(())
        }
        AdminCmd::Func(FuncArgs {
            cmd: FuncCmd::Ls, ..
        }) => {
            let funcs = admin.funcs().await?;
            if json {
                return print_json(&funcs);
            }
            let mut t = table(&[
                "id",
                "address",
                "zone",
                "status",
                "load",
                "calls/s",
                "in/s",
                "functions",
                "heartbeat",
            ]);
            for f in &funcs {
                t.add_row(vec![
                    f.id.to_string(),
                    f.addr.clone(),
                    f.zone.clone(),
                    format!("{:?}", f.status).to_lowercase(),
                    format!("{}/{}", f.load.outstanding, f.capacity),
                    f.load.calls_per_s.to_string(),
                    bytes(f.load.bytes_per_s),
                    functions(&f.functions),
                    format!("{:.1}s ago", f.last_heartbeat_ms_ago as f64 / 1000.0),
                ]);
            }
            println!("{t}");
            if funcs.is_empty() {
                println!(
                    "no function server registered (`nacre up --funcs N`, or `nacre server` with role = \"func\")"
                );
            }
            Ok(())
        }
        AdminCmd::Vol(VolArgs { cmd, .. }) => vol(admin, cmd, json).await,
        AdminCmd::Partition(PartitionArgs {
            cmd: PartitionCmd::List { volume },
            ..
        }) => {
            let ps = admin.partitions(volume.as_deref()).await?;
            if json {
                return print_json(&ps);
            }
            println!("{}", partition_table(&ps));
            Ok(())
        }
        AdminCmd::Tenant(TenantArgs { cmd, .. }) => match cmd {
            TenantCmd::Create { name } => {
                let t = admin.create_tenant(&name).await?;
                if json {
                    return print_json(&t);
                }
                println!("tenant {} created", t.name);
                println!("access key  {}", t.access_key);
                println!("secret key  {}   (shown only now)", t.secret_key);
                Ok(())
            }
            TenantCmd::List => {
                let ts = admin.tenants().await?;
                if json {
                    return print_json(&ts);
                }
                let mut t = table(&["tenant", "access key", "volumes"]);
                for x in &ts {
                    t.add_row(vec![
                        x.name.clone(),
                        x.access_key.clone(),
                        x.volumes.join(","),
                    ]);
                }
                println!("{t}");
                Ok(())
            }
            TenantCmd::Delete { name } => {
                admin.delete_tenant(&name).await?;
                if !json {
                    println!("tenant {name} deleted");
                }
                Ok(())
            }
        },
    }
}

fn volume_table(vs: &[VolumeInfo]) -> Table {
    let mut t = table(&[
        "volume",
        "owner",
        "replicas",
        "meta",
        "data (rw)",
        "inodes",
        "used",
        "capacity",
        "functions",
    ]);
    for v in vs {
        t.add_row(vec![
            v.name.clone(),
            v.owner.clone(),
            v.replicas.to_string(),
            v.meta_partitions.to_string(),
            format!("{} ({})", v.data_partitions, v.data_partitions_rw),
            v.inodes.to_string(),
            bytes(v.used),
            if v.capacity == 0 {
                "unlimited".into()
            } else {
                bytes(v.capacity)
            },
            v.functions.clone(),
        ]);
    }
    t
}

/// `data: 1.2 GiB in 310 files, stored in 402 MiB (0.33 of it) on each replica`; on an
/// erasure-coded volume, `… stored in 402 MiB (0.33 of it), 603 MiB with parity over 6 nodes`.
fn usage_line(u: &nacre_api::meta::Usage, ec: Option<nacre_func::EcSpec>) -> String {
    let ratio = if u.logical_bytes == 0 {
        String::new()
    } else {
        format!(
            " ({:.2} of it)",
            u.stored_bytes as f64 / u.logical_bytes as f64
        )
    };
    let place = match ec {
        None => " on each replica".to_string(),
        Some(ec) => format!(
            ", {} with parity over {} nodes",
            bytes(u.stored_bytes / u64::from(ec.k.max(1)) * ec.total() as u64),
            ec.total()
        ),
    };
    format!(
        "data: {} in {} files, stored in {}{ratio}{place}",
        bytes(u.logical_bytes),
        u.files,
        bytes(u.stored_bytes)
    )
}

fn partition_table(ps: &[PartitionInfo]) -> Table {
    let mut t = table(&[
        "partition",
        "volume",
        "kind",
        "inodes",
        "replicas",
        "leader",
        "status",
        "pending",
    ]);
    for p in ps {
        let range = match (p.start, p.end) {
            (Some(s), Some(e)) => format!("[{s}, {e})"),
            (Some(s), None) => format!("[{s}, ∞)"),
            _ => "-".into(),
        };
        t.add_row(vec![
            p.id.to_string(),
            p.volume.clone(),
            p.kind.clone(),
            range,
            ids(&p.replicas),
            p.leader.map_or("-".into(), |l| l.to_string()),
            format!("{:?}", p.status).to_uppercase(),
            p.ops_per_s.to_string(),
            ids(&p.pending),
        ]);
    }
    t
}

async fn vol(admin: &Admin, cmd: VolCmd, json: bool) -> anyhow::Result<()> {
    match cmd {
        VolCmd::Create(a) => {
            let req = CreateVolume {
                name: a.name.clone(),
                owner: a.owner,
                replicas: a.replicas,
                capacity: a.capacity as u64,
                meta_partitions: a.meta_partitions,
                data_partitions: a.data_partitions,
                inode_step: a.inode_step,
                compress: a.compress,
                func_at: a.func_at,
                fallback_inline: !a.no_fallback,
                ec: a.ec,
            };
            let v = admin.create_volume(&req).await?;
            // Wait (bounded) for the nodes to report every replica.
            let deadline = Instant::now() + Duration::from_secs_f64(a.wait.max(0.0));
            let mut pending = pending_of(admin, &a.name).await?;
            while !pending.is_empty() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(200)).await;
                pending = pending_of(admin, &a.name).await?;
            }
            if json {
                return print_json(&v);
            }
            println!("volume {} created", v.name);
            println!("{}", volume_table(std::slice::from_ref(&v)));
            if !pending.is_empty() {
                println!(
                    "warning: {} partition replicas are not created yet; the master keeps retrying \
                     (see `nacre cluster status`)",
                    pending.len()
                );
            }
            Ok(())
        }
        VolCmd::List => {
            let vs = admin.volumes().await?;
            if json {
                return print_json(&vs);
            }
            println!("{}", volume_table(&vs));
            Ok(())
        }
        VolCmd::Info { name } => {
            let d = admin.volume(&name).await?;
            if json {
                return print_json(&d);
            }
            println!("{}", volume_table(std::slice::from_ref(&d.volume)));
            println!("{}", partition_table(&d.partitions));
            match (&d.usage, &d.usage_error) {
                (Some(u), _) => println!("{}", usage_line(u, d.volume.ec)),
                (None, e) => println!(
                    "data: unknown ({})",
                    e.as_deref().unwrap_or("no meta partition answered")
                ),
            }
            let g = &d.gc;
            println!(
                "garbage collection (last sweep of each data partition): {} referenced, {} \
                 unreferenced ({} freed, {} kept: written within the grace); {} partitions not swept yet",
                bytes(g.referenced_bytes),
                bytes(g.unreferenced_bytes),
                bytes(g.freed_bytes),
                bytes(g.unreferenced_bytes.saturating_sub(g.freed_bytes)),
                g.unswept
            );
            for r in g.sweeps.iter().filter(|r| r.error.is_some()) {
                println!(
                    "  partition {}: the last sweep deleted nothing: {}",
                    r.partition,
                    r.error.as_deref().unwrap_or("")
                );
            }
            Ok(())
        }
        VolCmd::Gc { name, grace_secs } => {
            let grace = Duration::from_secs_f64(grace_secs.max(0.0));
            let rs = admin.sweep(&name, grace).await?;
            if json {
                return print_json(&rs);
            }
            let mut t = table(&["partition", "referenced", "unreferenced", "freed", "error"]);
            for r in &rs {
                t.add_row(vec![
                    r.partition.to_string(),
                    format!("{} ({})", r.referenced, bytes(r.referenced_bytes)),
                    format!("{} ({})", r.unreferenced, bytes(r.unreferenced_bytes)),
                    format!("{} ({})", r.freed, bytes(r.freed_bytes)),
                    r.error.clone().unwrap_or_default(),
                ]);
            }
            println!("{t}");
            Ok(())
        }
        VolCmd::Delete { name } => {
            admin.delete_volume(&name).await?;
            if !json {
                println!("volume {name} deleted");
            }
            Ok(())
        }
    }
}

async fn pending_of(admin: &Admin, volume: &str) -> anyhow::Result<Vec<(String, String)>> {
    Ok(admin
        .partitions(Some(volume))
        .await?
        .iter()
        .flat_map(|p| p.pending.iter().map(|n| (p.id.to_string(), n.to_string())))
        .collect())
}
