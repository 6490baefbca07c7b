from tidal.cli import main

main()
