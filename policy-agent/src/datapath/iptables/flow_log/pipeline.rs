//! The iptables datapath's records in the flow pipeline: NFLOG as a
//! record source, the names file as a name source.
use std::{
    collections::BTreeMap,
    net::IpAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use policy_common::event::FlowRecord;

use super::{IptablesFlowReader, read_names};
use crate::datapath::bpf::{
    flows::{
        Error,
        naming::{NameSource, Names},
        pipeline::RecordSource,
    },
    loader::endpoint_meta,
    name_tables::NameTables,
};

impl RecordSource for IptablesFlowReader {
    fn next_batch(&mut self, timeout: Duration) -> Vec<FlowRecord> {
        IptablesFlowReader::next_batch(self, timeout)
    }

    fn lost(&self) -> u64 {
        self.stats().lost
    }
}

/// Names read from the file the iptables driver writes on every sync.
pub struct FileNames {
    path: PathBuf,
}

impl FileNames {
    pub fn new(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
        }
    }
}

impl NameSource for FileNames {
    fn read(&mut self) -> Result<Names, Error> {
        let file = read_names(&self.path)?;
        let mut addresses: BTreeMap<IpAddr, u32> = BTreeMap::new();
        for (ifindex, ips) in &file.pod_addresses {
            for ip in ips {
                addresses.insert(*ip, *ifindex);
            }
        }
        Ok(Names {
            tables: NameTables {
                identities: file.identities,
                endpoints: file
                    .pods
                    .iter()
                    .map(|(ifindex, pod)| (*ifindex, endpoint_meta(pod, 0)))
                    .collect(),
                rules: file.rules,
            },
            addresses,
        })
    }
}
