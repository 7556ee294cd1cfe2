"""The link between the processes of a multi-process server: the frame protocol over Unix sockets (``frames``),
the shared-memory arena of each HTTP process (``shm``), and what the processes tell each other outside the frames
(``process``). docs/protocol.md describes the wire.
"""
