import sys

from rlhf_cli.tinker_service.server import main

sys.exit(main())
