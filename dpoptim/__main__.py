from dpoptim.cli import main

raise SystemExit(main())
