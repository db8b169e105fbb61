"""`python -m env_servers.retriever`: see `env_servers.retriever.server`."""

import sys

from env_servers.retriever import server

sys.exit(server.main())
