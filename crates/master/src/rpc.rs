//! The master's admin messages: what admins send to the master leader and the whole map it
//! answers with. The messages nodes and clients send are in `nacre_api::master`.

use nacre_api::master::{MapError, MasterError};
use nacre_client::MasterClient;
use nacre_proto::Op;
use nacre_proto::msg::Rpc;
use serde::{Deserialize, Serialize};

use crate::map::{ClusterMap, Command, Outcome};

/// Executes an admin command on the master leader (op `0x0101`).
#[derive(Debug)]
pub struct Execute;

impl Rpc for Execute {
    const OP: Op = Op(0x0101);
    const NAME: &'static str = "master_execute";
    type Request = Command;
    type Response = Result<Outcome, MapError>;
}

/// Reads the whole cluster map from the master leader (op `0x0102`).
#[derive(Debug)]
pub struct GetMap;

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct GetMapRequest {}

impl Rpc for GetMap {
    const OP: Op = Op(0x0102);
    const NAME: &'static str = "master_get_map";
    type Request = GetMapRequest;
    type Response = ClusterMap;
}

/// The admin calls on a [`MasterClient`] that carry the master's own types.
pub trait MasterAdmin {
    /// Executes a command on the leader.
    fn execute(&self, cmd: &Command) -> impl Future<Output = Result<Outcome, MasterError>> + Send;
    /// Reads the whole map from the leader.
    fn cluster_map(&self) -> impl Future<Output = Result<ClusterMap, MasterError>> + Send;
}

impl MasterAdmin for MasterClient {
    async fn execute(&self, cmd: &Command) -> Result<Outcome, MasterError> {
        self.call::<Execute>(cmd).await?.map_err(MasterError::from)
    }

    async fn cluster_map(&self) -> Result<ClusterMap, MasterError> {
        self.call::<GetMap>(&GetMapRequest {}).await
    }
}
