from batcher.cli import main

main()
