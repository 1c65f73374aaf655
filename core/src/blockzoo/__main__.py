from blockzoo.cli import main

raise SystemExit(main())
