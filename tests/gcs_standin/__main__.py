"""`python -m tests.gcs_standin CERT KEY PORT UPSTREAM_PORT`: the stand-in's front, in a process of its own."""
import sys

from tests.gcs_standin import serve_front

serve_front(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
