"""Starting pdserve: the ``pdserve`` CLI (``args`` parses, ``cli`` runs commands), the launcher and
its supervisor, worker ports and roles, and the readiness probe."""
