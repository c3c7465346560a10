import java.io.ByteArrayOutputStream;
import java.io.DataInputStream;
import java.io.FileDescriptor;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.util.List;
import java.util.Locale;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.stream.Collectors;

import jdk.jshell.Diag;
import jdk.jshell.EvalException;
import jdk.jshell.JShell;
import jdk.jshell.JShellException;
import jdk.jshell.Snippet;
import jdk.jshell.SnippetEvent;
import jdk.jshell.SourceCodeAnalysis;
import jdk.jshell.UnresolvedReferenceException;
import jdk.jshell.VarSnippet;

/**
 * A Java context of agentenv's code interpreter (server.py): JShell in this JVM.
 *
 * <p>Requests on stdin: {@code EXEC <silent 0|1> <bytes>\n} and that many bytes of UTF-8 code, or
 * {@code STOP\n} (interrupt the running cell). Replies on stdout, one JSON object per line: {@code ready}
 * once, then per cell {@code stdout}/{@code stderr} text as it is printed, at most one {@code result}
 * (the value of a last expression) or one {@code error}, and {@code done}. A silent cell sends only
 * {@code done}. Code runs with {@code System.out} and {@code System.err} sent as {@code stdout} and
 * {@code stderr}; nothing else writes to the real stdout.
 */
public final class K3JShell {
    private static final PrintStream PROTO =
            new PrintStream(new FileOutputStream(FileDescriptor.out), false, StandardCharsets.UTF_8);
    /** Imported in every context, as by the `jshell` tool. */
    private static final String[] IMPORTS = {
        "java.io", "java.math", "java.net", "java.nio.file", "java.util", "java.util.concurrent",
        "java.util.function", "java.util.prefs", "java.util.regex", "java.util.stream",
    };
    /** Whether the running cell's output is dropped (a silent cell). */
    private static volatile boolean quiet;

    private record Cell(boolean silent, String code) {}

    public static void main(String[] args) throws Exception {
        InputStream requests = System.in;
        System.setIn(InputStream.nullInputStream()); // code that reads stdin reads no requests
        System.setOut(new Printer(new Stream("stdout")));
        System.setErr(new Printer(new Stream("stderr")));
        JShell js = JShell.builder()
                .executionEngine("local")
                .out(System.out)
                .err(System.err)
                .build();
        LinkedBlockingQueue<Cell> cells = new LinkedBlockingQueue<>();
        Thread reader = new Thread(() -> read(requests, js, cells), "k3-requests");
        reader.setDaemon(true);
        reader.start();
        for (String pkg : IMPORTS) {
            js.eval("import " + pkg + ".*;"); // also loads the compiler before the context counts as ready
        }
        send("{\"type\":\"ready\"}");
        while (true) {
            Cell cell = cells.take();
            if (cell.code() == null) {
                System.exit(0);
            }
            quiet = cell.silent();
            try {
                run(js, cell.code());
            } catch (RuntimeException e) {
                error("InternalError", String.valueOf(e), "");
            }
            System.out.flush();
            System.err.flush();
            quiet = false;
            send("{\"type\":\"done\"}");
        }
    }

    /** Requests from stdin; a STOP stops the running cell at once, EOF ends the process. */
    private static void read(InputStream requests, JShell js, LinkedBlockingQueue<Cell> cells) {
        DataInputStream in = new DataInputStream(requests);
        try {
            while (true) {
                String line = line(in);
                if (line == null) {
                    break;
                }
                String[] w = line.split(" ");
                if (w[0].equals("STOP")) {
                    js.stop();
                } else if (w[0].equals("EXEC") && w.length == 3) {
                    byte[] code = new byte[Integer.parseInt(w[2])];
                    in.readFully(code);
                    cells.add(new Cell(w[1].equals("1"), new String(code, StandardCharsets.UTF_8)));
                } else {
                    break;
                }
            }
        } catch (IOException | NumberFormatException e) {
            // the server went away or broke the protocol: end like at EOF
        }
        cells.add(new Cell(false, null));
    }

    private static String line(DataInputStream in) throws IOException {
        ByteArrayOutputStream b = new ByteArrayOutputStream();
        for (int c = in.read(); c != '\n'; c = in.read()) {
            if (c < 0) {
                return null;
            }
            b.write(c);
        }
        return b.toString(StandardCharsets.UTF_8);
    }

    /** Evaluates a cell snippet by snippet; the first error ends it. */
    private static void run(JShell js, String code) {
        SourceCodeAnalysis sca = js.sourceCodeAnalysis();
        String rest = code;
        String value = null;
        while (!rest.isBlank()) {
            SourceCodeAnalysis.CompletionInfo ci = sca.analyzeCompletion(rest);
            String src;
            if (ci.completeness() == SourceCodeAnalysis.Completeness.EMPTY) {
                break;
            } else if (ci.completeness().isComplete()) {
                src = ci.source();
                rest = ci.remaining();
            } else {
                src = rest; // incomplete: its compile error says why
                rest = "";
            }
            value = null;
            for (SnippetEvent ev : js.eval(src)) {
                if (ev.causeSnippet() != null) {
                    continue; // an update of a dependent snippet
                }
                Snippet s = ev.snippet();
                if (ev.status() == Snippet.Status.REJECTED) {
                    String diags = js.diagnostics(s)
                            .map(d -> diag(d, s.source()))
                            .collect(Collectors.joining("\n"));
                    error("CompilationException", diags, s.source());
                    return;
                }
                if (ev.exception() != null) {
                    thrown(ev.exception());
                    return;
                }
                if (ev.value() != null && !ev.value().equals("null") && shown(s)) {
                    value = ev.value(); // a null shows nothing, as in Jupyter
                }
            }
        }
        if (value != null && !quiet) {
            send("{\"type\":\"result\",\"text\":" + json(unquote(value)) + "}");
        }
    }

    /** Expressions show their value, as in Jupyter; declarations and statements do not. */
    private static boolean shown(Snippet s) {
        return s.kind() == Snippet.Kind.EXPRESSION
                || (s instanceof VarSnippet && s.subKind() == Snippet.SubKind.TEMP_VAR_EXPRESSION_SUBKIND);
    }

    private static String diag(Diag d, String src) {
        String msg = d.getMessage(Locale.ROOT);
        long at = d.getStartPosition();
        if (at < 0 || at > src.length()) {
            return msg;
        }
        int start = src.lastIndexOf('\n', (int) at - 1) + 1;
        int end = src.indexOf('\n', (int) at);
        String line = src.substring(start, end < 0 ? src.length() : end);
        return msg + "\n" + line + "\n" + " ".repeat((int) at - start) + "^";
    }

    private static void thrown(JShellException e) {
        String name;
        if (e instanceof EvalException ee) {
            name = ee.getExceptionClassName();
        } else if (e instanceof UnresolvedReferenceException ure) {
            name = "UnresolvedReferenceException";
            error(name, "unresolved: " + ure.getSnippet().source().strip(), "");
            return;
        } else {
            name = e.getClass().getName();
        }
        StringBuilder tb = new StringBuilder(name);
        if (e.getMessage() != null) {
            tb.append(": ").append(e.getMessage());
        }
        for (StackTraceElement f : e.getStackTrace()) {
            tb.append("\n\tat ").append(f);
        }
        error(name.substring(name.lastIndexOf('.') + 1), e.getMessage() == null ? "" : e.getMessage(), tb.toString());
    }

    private static void error(String name, String value, String traceback) {
        if (!quiet) {
            send("{\"type\":\"error\",\"name\":" + json(name) + ",\"value\":" + json(value)
                    + ",\"traceback\":" + json(traceback) + "}");
        }
    }

    /** JShell shows a String or char as a Java literal; a result is its text, as Jupyter kernels give it. */
    static String unquote(String v) {
        int n = v.length();
        if (n < 2 || !((v.charAt(0) == '"' && v.charAt(n - 1) == '"')
                || (v.charAt(0) == '\'' && v.charAt(n - 1) == '\''))) {
            return v;
        }
        StringBuilder b = new StringBuilder(n);
        for (int i = 1; i < n - 1; i++) {
            char c = v.charAt(i);
            if (c != '\\' || i + 1 >= n - 1) {
                b.append(c);
                continue;
            }
            char e = v.charAt(++i);
            switch (e) {
                case 'n' -> b.append('\n');
                case 't' -> b.append('\t');
                case 'r' -> b.append('\r');
                case 'b' -> b.append('\b');
                case 'f' -> b.append('\f');
                case '0', '1', '2', '3', '4', '5', '6', '7' -> {
                    int j = i;
                    while (j < n - 1 && j < i + 3 && v.charAt(j) >= '0' && v.charAt(j) <= '7') {
                        j++;
                    }
                    b.append((char) Integer.parseInt(v.substring(i, j), 8));
                    i = j - 1;
                }
                case 'u' -> {
                    if (i + 4 < n - 1) {
                        b.append((char) Integer.parseInt(v.substring(i + 1, i + 5), 16));
                        i += 4;
                    }
                }
                default -> b.append(e);
            }
        }
        return b.toString();
    }

    static String json(String s) {
        StringBuilder b = new StringBuilder(s.length() + 2).append('"');
        for (int i = 0; i < s.length(); i++) {
            char c = s.charAt(i);
            switch (c) {
                case '"' -> b.append("\\\"");
                case '\\' -> b.append("\\\\");
                case '\n' -> b.append("\\n");
                case '\r' -> b.append("\\r");
                case '\t' -> b.append("\\t");
                default -> {
                    if (c < 0x20) {
                        b.append(String.format("\\u%04x", (int) c));
                    } else {
                        b.append(c);
                    }
                }
            }
        }
        return b.append('"').toString();
    }

    private static void send(String line) {
        synchronized (PROTO) {
            PROTO.print(line);
            PROTO.print('\n');
            PROTO.flush();
        }
    }

    /**
     * {@code System.out} and {@code System.err}. A subclass, so that {@code println} writes its text and
     * its line end apart, which E2B's Java kernel sends as two outputs.
     */
    private static final class Printer extends PrintStream {
        Printer(Stream s) {
            super(s, true, StandardCharsets.UTF_8);
        }
    }

    /** What code prints: sent as text at each write of bytes (each print), a flush and the end of a cell. */
    private static final class Stream extends OutputStream {
        private final String name;
        private final ByteArrayOutputStream buf = new ByteArrayOutputStream();

        Stream(String name) {
            this.name = name;
        }

        @Override
        public synchronized void write(int b) {
            buf.write(b);
            if (b == '\n' || buf.size() >= 8192) {
                flush();
            }
        }

        @Override
        public synchronized void write(byte[] b, int off, int len) {
            buf.write(b, off, len);
            flush();
        }

        @Override
        public synchronized void flush() {
            byte[] all = buf.toByteArray();
            int cut = whole(all);
            buf.reset();
            buf.write(all, cut, all.length - cut); // a character's bytes split by a write wait
            if (cut > 0 && !quiet) {
                String text = new String(all, 0, cut, StandardCharsets.UTF_8);
                send("{\"type\":\"" + name + "\",\"text\":" + json(text) + "}");
            }
        }

        /** The length of `b` without an incomplete UTF-8 sequence at its end. */
        private static int whole(byte[] b) {
            int n = b.length;
            for (int back = 1; back <= Math.min(3, n); back++) {
                int c = b[n - back] & 0xff;
                if ((c & 0xc0) == 0x80) {
                    continue; // a continuation byte: look for its lead
                }
                int need = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
                return need > back ? n - back : n;
            }
            return n;
        }
    }
}
