from workflows.cli import main

main()
