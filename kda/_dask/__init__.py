"""The parts of :mod:`kda.dask`, one job each: :mod:`~kda._dask.plan` (how the inputs are cut into
blocks: time, heads, batch, and the packed sequences' shards), :mod:`~kda._dask.graph` (the layer
of tasks on the blocks: its keys, the rechunked inputs, each block's check and the scans over
time shards), :mod:`~kda._dask.tasks` (what runs on one block, on the blocks' own array library;
every task returns a named record, which the graph reads by field name). :mod:`kda.dask` itself
holds the public functions."""
