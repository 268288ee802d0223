"""The Tinker protocol (``/api/v1/*``): the ``tinker`` SDK as a client of trainctl.

``proto`` declares the wire-compatible protobuf messages, ``convert`` maps Tinker's data,
losses and results to trainctl's own API, ``state`` keeps sessions, model handles, ``seq_id``
order, deduplication and futures, and ``routes`` serves it all on the gateway."""
