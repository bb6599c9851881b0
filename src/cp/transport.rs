//! Moving K/V blocks one place round the ring.

use crate::error::{Error, Result};

/// Moves each rank's block to its successor: after [`Transport::shift`], the block rank
/// `(r − 1) mod N` sent is in rank `r`'s receive buffer.
///
/// A transport drives the ranks of this process ([`Transport::local_ranks`]): all `N` for the
/// in-memory ring and for NCCL with one process driving every GPU, one for NCCL with one
/// process per GPU. `send` and `recv` hold one block per local rank, in that order.
pub trait Transport {
    /// A K/V block: a host buffer, a device buffer.
    type Block;

    /// Ranks in the ring.
    fn world_size(&self) -> usize;

    /// The ranks this process drives, in the order of `send` and `recv`.
    fn local_ranks(&self) -> Vec<usize>;

    /// Sends every local rank's `send` block to its successor and receives its predecessor's
    /// into `recv`. `step` is the ring step the blocks are for (`send` holds the K/V of rank
    /// `(r − step) mod N`), which fixes every block's length. Completion: on return for host
    /// transports; in stream order for device transports (see their docs).
    fn shift(&mut self, step: usize, send: &[Self::Block], recv: &mut [Self::Block]) -> Result<()>;
}

/// `N` simulated ranks in one process exchanging host blocks by copying.
#[derive(Debug, Clone)]
pub struct InMemory {
    ranks: usize,
    bytes: u64,
}

impl InMemory {
    /// A ring of `ranks ≥ 1` simulated ranks.
    pub fn new(ranks: usize) -> Result<InMemory> {
        if ranks == 0 {
            return Err(Error::invalid("ranks", "must be at least 1, got 0"));
        }
        Ok(InMemory { ranks, bytes: 0 })
    }

    /// Bytes moved so far.
    pub fn bytes_moved(&self) -> u64 {
        self.bytes
    }
}

impl Transport for InMemory {
    type Block = Vec<f32>;

    fn world_size(&self) -> usize {
        self.ranks
    }

    fn local_ranks(&self) -> Vec<usize> {
        (0..self.ranks).collect()
    }

    fn shift(&mut self, _step: usize, send: &[Vec<f32>], recv: &mut [Vec<f32>]) -> Result<()> {
        let n = self.ranks;
        if send.len() != n || recv.len() != n {
            return Err(Error::invalid(
                "send",
                format!(
                    "{} send and {} receive blocks for {n} ranks",
                    send.len(),
                    recv.len()
                ),
            ));
        }
        for (r, block) in send.iter().enumerate() {
            let to = &mut recv[(r + 1) % n];
            to.clear();
            to.extend_from_slice(block);
            self.bytes += std::mem::size_of_val(block.as_slice()) as u64;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_move_one_place_round_the_ring() {
        let mut t = InMemory::new(3).unwrap();
        let send = vec![vec![0.0], vec![1.0, 1.0], vec![2.0]];
        let mut recv = vec![Vec::new(); 3];
        t.shift(0, &send, &mut recv).unwrap();
        assert_eq!(recv, vec![vec![2.0], vec![0.0], vec![1.0, 1.0]]);
        assert_eq!(t.bytes_moved(), 16);
        assert!(t.shift(0, &send[..2], &mut recv).is_err());
    }
}
