from rqbatcher.cli import main

main()
