"""The contract every layer speaks: the snapshot types, errors that carry their fix, the bundle format.

``snapshot`` holds the frozen dataclasses probes fill and analyzers read,
``errors`` the ``RankscopeError`` every failure a person can act on is raised
as, ``bundle`` the versioned JSON a capture is saved in. This package must stay
cheap to import: analyzers import it, so it imports nothing here.
"""
