"""Command-line tools with DeepSpeed's names and flags (installed as `ds_bench`, `ds_io`, `ds_nvme_tune`,
`ds_ssh` by the `deepspeed` alias, and as `shardspeed-bench`, `shardspeed-io`, ... by shardspeed itself):

- comm_bench.py: collective bandwidth over torch.distributed (`ds_bench`);
- io_bench.py: file I/O speed of the NVMe tier's async I/O (`ds_io`);
- nvme_tune.py: a sweep of `io_bench` settings that prints the best `aio` config block (`ds_nvme_tune`);
- ssh_all.py: one command on every host of a hostfile (`ds_ssh`).
"""
